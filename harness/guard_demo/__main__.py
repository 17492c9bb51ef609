"""The main job: what the guard is for, then a real OpenAI-compatible vLLM server with it.

``python -m guard_demo`` does, on loopback only:

1. generates the tiny Llama checkpoint (:mod:`guard_demo.tiny_model`);
2. proves the bug and the fix on that model (:mod:`guard_demo.engine_proof`, in a process of
   its own, printed as soon as it is done): three in-process engines run a request that is
   preempted in the step that scheduled it and a later request with its prompt; stock prefix
   caching diverges from the engine without prefix caching (the first diverging token and
   its logprob gap are reported), the guarded engine matches it within float noise;
3. starts two ``vllm.entrypoints.openai.api_server`` processes side by side
   (:mod:`guard_demo.server`): the *guarded* server (``VLLM_PREFIX_GUARD=1``,
   automatic prefix caching, priority scheduling, a KV cache of a few dozen blocks per engine
   so that preemption is routine; ``--data-parallel-size N`` gives it N EngineCores) and a
   *reference* server (no prefix caching, a KV cache large enough never to preempt);
4. drives a timed ``/v1/completions`` workload at the guarded server
   (:func:`~guard_demo.workload.make_workload`): waves of a long low-priority prompt
   followed by high-priority ones, shared prefixes, repeated prompts, client disconnects (which
   vLLM turns into aborts), greedy decoding with top-5 logprobs;
5. replays every request that completed on the reference server and compares token ids and
   logprobs (:mod:`guard_demo.reference_check`);
6. prints the proof, then requests, prefix-cache hit rate and preemptions, the guard's
   counters per engine (all from ``/metrics``), guard rollbacks and mismatches, and exits
   non-zero unless stock diverged and the guard matched in the proof and no completion of
   the server differs.

Both servers are stopped the way vLLM expects (SIGTERM, then vLLM's own shutdown) on every exit
path (normal return, exception, Ctrl-C, SIGTERM), so no EngineCore or worker process outlives
the demo; the report says whether their logs show a clean stop. ``--metrics-trace FILE`` saves
the guarded server's ``/metrics`` sampled every second (for ``examples/grafana/plot_metrics.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from guard_demo.compare import LOGPROB_ATOL
from guard_demo.engine_proof import EngineProof
from guard_demo.metrics import (
    MetricsSnapshot,
    MetricsTracer,
    per_engine,
    read_guard_rollbacks,
    settled_scrape,
)
from guard_demo.reference_check import check_against_reference
from guard_demo.server import (
    GUARDED_NUM_GPU_BLOCKS,
    REFERENCE_NUM_GPU_BLOCKS,
    STARTUP_TIMEOUT_S,
    ApiServer,
    ServerExited,
    http_get_text,
    known_vllm_shutdown_race,
    shutdown_problems,
)
from guard_demo.workload import make_workload

__all__ = ["DemoOptions", "DemoReport", "main", "run_demo"]


@dataclass
class DemoReport:
    """Counts the demo prints; ``ok`` is what the exit status reflects."""

    guard: bool
    vllm_version: str
    requests: int
    completed: int
    cancelled: int
    failed: int
    metrics: MetricsSnapshot
    guard_rollbacks: int | None
    mismatches: dict[str, str] = field(default_factory=dict)
    elapsed_s: float = 0.0
    #: vLLM's and the guard's counters per engine, read from the guarded server's /metrics.
    guard_by_engine: dict[str, dict[str, float]] = field(default_factory=dict)
    #: Per server log: lines showing an unclean stop, and processes that had to be killed.
    shutdown: dict[str, list[str]] = field(default_factory=dict)
    #: Server logs with vLLM's own shutdown-race traceback (vllm#48745), not counted above.
    vllm_shutdown_race: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    model_dir: Path | None = None
    data_parallel_size: int = 1
    #: The engine-level proof (None: not run, or it failed: :attr:`engine_proof_error`).
    engine_proof: EngineProof | None = None
    engine_proof_error: str | None = None

    @property
    def ok(self) -> bool:
        proof_ok = self.engine_proof_error is None and (
            self.engine_proof is None or self.engine_proof.ok
        )
        return proof_ok and not self.mismatches and not self.failed

    @property
    def hit_rate(self) -> float:
        queries = self.metrics.prefix_cache_queries
        return self.metrics.prefix_cache_hits / queries if queries else math.nan

    @property
    def shutdown_problems(self) -> dict[str, list[str]]:
        """Server log -> its lines showing an unclean stop, for the logs that have any."""
        return {name: found for name, found in self.shutdown.items() if found}

    def shutdown_summary(self) -> str:
        """How the servers stopped, in one line: clean, orderly but for vLLM's own known
        race, or with problems (listed below it in the report)."""
        problems = self.shutdown_problems
        if problems:
            counts = "; ".join(
                f"{name}: {len(found)} problem(s)" for name, found in problems.items()
            )
            race = f"; also {_race(self.vllm_shutdown_race)}" if self.vllm_shutdown_race else ""
            return f"NOT CLEAN: {counts}{race}"
        if self.vllm_shutdown_race:
            return f"orderly (no force-kill), with {_race(self.vllm_shutdown_race)}"
        return "clean (no traceback, no force-kill in the server logs)"

    def render(self) -> str:
        rollbacks = "n/a" if self.guard_rollbacks is None else str(self.guard_rollbacks)
        engines = f", {self.data_parallel_size} engines" if self.data_parallel_size > 1 else ""
        lines = [f"vllm-prefix-guard demo (vLLM {self.vllm_version}, {self.elapsed_s:.0f}s)"]
        if self.engine_proof is not None or self.engine_proof_error is not None:
            lines.append(
                "1. the bug and the fix on one engine (in-process LLMEngine, the same tiny model)"
            )
            if self.engine_proof is not None:
                lines += self.engine_proof.render()
            else:
                lines.append(f"  verdict           FAILED to run: {self.engine_proof_error}")
            lines.append(
                "2. the server under load, every completion replayed without prefix caching"
            )
        lines += [
            f"  server            guard {'on' if self.guard else 'off (stock vLLM)'}{engines}",
            f"  requests          {self.requests} sent, {self.completed} completed, "
            f"{self.cancelled} cancelled, {self.failed} failed",
            f"  prefix-cache hits {self.hit_rate:.1%} "
            f"({self.metrics.prefix_cache_hits:.0f} of {self.metrics.prefix_cache_queries:.0f}"
            " tokens)",
            f"  preemptions       {self.metrics.preemptions:.0f}",
            f"  guard rollbacks   {rollbacks}",
        ]
        if self.guard_by_engine:
            lines.append("  per engine        (from /metrics)")
            lines += [f"    engine {e}: {_guard_line(c)}" for e, c in self.guard_by_engine.items()]
        lines.append(
            f"  mismatches        {len(self.mismatches)} "
            f"(vs. no prefix caching, logprob atol {LOGPROB_ATOL:g})"
        )
        lines += [f"    {rid}: {problem}" for rid, problem in list(self.mismatches.items())[:10]]
        lines.append("  shutdown          " + self.shutdown_summary())
        for name, found in self.shutdown_problems.items():
            lines += [f"    {name}: {line[:160]}" for line in found[:3]]
        if self.log_dir is not None:
            lines.append(f"  server logs       {self.log_dir}")
        if self.model_dir is not None:
            lines.append(f"  model             {self.model_dir}")
        lines.append("  result            " + ("OK" if self.ok else "FAILED"))
        return "\n".join(lines)


def _race(logs: list[str]) -> str:
    return (
        f"vLLM's known shutdown race in {', '.join(logs)} (an EngineDeadError traceback "
        "after the stop, guard or not; vllm#48745)"
    )


def _guard_line(counters: dict[str, float]) -> str:
    """One engine's line: vLLM's hit rate and preemptions, then the guard's counters."""

    def n(key: str) -> int:
        return int(counters.get(key, 0))

    queries = counters.get("prefix_cache_queries", 0.0)
    hits = f"{counters.get('prefix_cache_hits', 0.0) / queries:.1%}" if queries else "n/a"
    if "registrations_tracked" not in counters:  # stock vLLM: no guard series
        return f"hits {hits}, {n('preemptions')} preemptions; no guard series"
    return (
        f"hits {hits}, {n('preemptions')} preemptions; guard: "
        f"{n('registrations_tracked')} registrations tracked, {n('rolled_back')} rolled back\n"
        f"              ({n('rolled_back_preempted')} preempted, "
        f"{n('rolled_back_kv_load_failure')} KV-load failure, "
        f"{n('rolled_back_dropped_step')} dropped step),\n"
        f"              {n('dependents_preempted')} dependents preempted, "
        f"{n('stale_entries_skipped')} stale records skipped"
    )


@dataclass(frozen=True)
class DemoOptions:
    requests: int = 64
    seed: int = 0
    guard: bool = True
    num_gpu_blocks: int = GUARDED_NUM_GPU_BLOCKS
    timeout_s: float = 600.0
    startup_timeout_s: float = STARTUP_TIMEOUT_S
    model_dir: Path | None = None
    log_dir: Path | None = None
    data_parallel_size: int = 1
    metrics_trace: Path | None = None
    engine_proof: bool = True


#: Seconds the engine-level proof may take (three small engines; about a minute alone on two
#: idle cores).
ENGINE_PROOF_TIMEOUT_S = 900.0


def run_engine_proof(model_dir: Path, log_dir: Path) -> tuple[EngineProof | None, str | None]:
    """``python -m guard_demo.engine_proof`` in its own process (it loads vLLM and applies
    the guard in-process), its output in ``engine-proof.log``, its result in
    ``engine-proof.json``: the proof, or why there is none."""
    env = dict(os.environ)
    env.pop("VLLM_PREFIX_GUARD", None)
    harness = str(Path(__file__).resolve().parents[1])
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([harness, *(p for p in paths if p != harness)])
    result, log_path = log_dir / "engine-proof.json", log_dir / "engine-proof.log"
    command = [sys.executable, "-m", "guard_demo.engine_proof", "--model-dir", str(model_dir)]
    command += ["--json", str(result)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            returncode = proc.wait(timeout=ENGINE_PROOF_TIMEOUT_S)
        except BaseException:  # the timeout, Ctrl-C, SIGTERM: no engine outlives the demo
            proc.kill()
            proc.wait()
            if not isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
                raise
            return None, f"no result after {ENGINE_PROOF_TIMEOUT_S:.0f}s (log: {log_path})"
    if returncode not in (0, 1) or not result.exists():
        return None, f"exit status {returncode} (log: {log_path})"
    return EngineProof.from_json(json.loads(result.read_text())), None


def run_demo(options: DemoOptions) -> DemoReport:
    """Run the whole demo; servers are stopped before this returns or raises."""
    from guard_demo.tiny_model import default_model_dir, generate_tiny_model

    started = time.monotonic()
    model_dir = generate_tiny_model(options.model_dir or default_model_dir())
    log_dir = options.log_dir or Path(tempfile.mkdtemp(prefix="vllm-prefix-guard-demo-"))
    # One file per engine; the guard puts the engine's index (data-parallel rank) there.
    stats_file = log_dir / "guard-stats.engine{engine}.json"
    guarded = ApiServer.for_model(
        model_dir,
        log_dir / "guarded-server.log",
        guard="1" if options.guard else None,
        stats_file=stats_file,
        prefix_caching=True,
        num_gpu_blocks=options.num_gpu_blocks,
        data_parallel_size=options.data_parallel_size,
    )
    reference = ApiServer.for_model(
        model_dir,
        log_dir / "reference-server.log",
        guard=None,
        prefix_caching=False,
        num_gpu_blocks=REFERENCE_NUM_GPU_BLOCKS,
    )
    print(f"model: {model_dir}\nserver logs: {log_dir}", flush=True)
    proof: tuple[EngineProof | None, str | None] = (None, None)
    if options.engine_proof:
        # First, and alone: on a small machine the three engines and two servers starting
        # at once only take turns on the same cores.
        print("engine-level proof (three in-process engines) ...", flush=True)
        proof = run_engine_proof(model_dir, log_dir)
        verdict = proof[0].render()[-1].split(maxsplit=1)[1] if proof[0] else proof[1]
        print(f"engine-level proof: {verdict}", flush=True)
    report = _serve_and_check(options, guarded, reference, stats_file)
    report.engine_proof, report.engine_proof_error = proof
    report.elapsed_s = time.monotonic() - started
    report.log_dir, report.model_dir = log_dir, model_dir
    return report


def _serve_and_check(
    options: DemoOptions, guarded: ApiServer, reference: ApiServer, stats_file: Path
) -> DemoReport:
    """Start both servers, run the workload and its replay, stop both; the report's server
    part."""
    with guarded, reference:
        # Both start at once: startup is mostly imports, which overlap well.
        guarded.wait_healthy(options.startup_timeout_s)
        reference.wait_healthy(options.startup_timeout_s)
        version = str(_get_json(f"{guarded.url}/version").get("version", "?"))
        tracer = MetricsTracer(guarded.url) if options.metrics_trace is not None else None
        with tracer or contextlib.nullcontext():
            check = check_against_reference(
                guarded.url,
                reference.url,
                make_workload(options.requests, options.seed),
                timeout_s=options.timeout_s,
                show_progress=True,
            )
        if tracer is not None and options.metrics_trace is not None:
            trace = tracer.to_json(
                guard=options.guard,
                data_parallel_size=options.data_parallel_size,
                requests=options.requests,
                seed=options.seed,
                num_gpu_blocks=options.num_gpu_blocks,
                vllm_version=version,
                result={
                    "completed": len(check.completed),
                    "cancelled": len(check.cancelled),
                    "failed": len(check.failures),
                    "mismatches": len(check.mismatches),
                },
            )
            options.metrics_trace.write_text(json.dumps(trace, indent=1))
            print(f"metrics trace: {options.metrics_trace}", flush=True)
        guard_by_engine = per_engine(settled_scrape(guarded.url))
        # Both stop at once; the guarded server before its final counters are read (the
        # guard's last write is at shutdown).
        reference.terminate()
        guarded.stop()
    for failure in check.failures[:5]:
        print(f"request {failure.item.request_id} failed: {failure.error}", file=sys.stderr)
    return DemoReport(
        guard=options.guard,
        vllm_version=version,
        requests=len(check.outcomes),
        completed=len(check.completed),
        cancelled=len(check.cancelled),
        failed=len(check.failures),
        metrics=check.metrics,
        guard_rollbacks=read_guard_rollbacks(stats_file, guarded.log_text()),
        mismatches=check.mismatches,
        guard_by_engine=guard_by_engine,
        shutdown={
            server.log_path.name: shutdown_problems(server.log_text())
            + [f"force-killed pid {pid}" for pid in server.force_killed]
            for server in (guarded, reference)
        },
        vllm_shutdown_race=[
            server.log_path.name
            for server in (guarded, reference)
            if known_vllm_shutdown_race(server.log_text())
        ],
        data_parallel_size=options.data_parallel_size,
    )


def _get_json(url: str) -> dict[str, Any]:
    value = json.loads(http_get_text(url))
    return value if isinstance(value, dict) else {}


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into ``SystemExit`` so that ``finally`` blocks stop the servers."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _parse_args(argv: Sequence[str] | None) -> DemoOptions:
    parser = argparse.ArgumentParser(
        prog="python -m guard_demo",
        description="Serve a tiny model with the prefix guard under preemption pressure and "
        "check every completion against a server without prefix caching.",
    )
    parser.add_argument("--requests", type=int, default=DemoOptions.requests)
    parser.add_argument("--seed", type=int, default=DemoOptions.seed)
    parser.add_argument(
        "--no-guard",
        dest="guard",
        action="store_false",
        help="run stock vLLM (VLLM_PREFIX_GUARD unset) to compare",
    )
    parser.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=DemoOptions.num_gpu_blocks,
        help="KV blocks of 32 tokens, null block included (default: %(default)s)",
    )
    parser.add_argument(
        "--timeout",
        dest="timeout_s",
        type=float,
        default=DemoOptions.timeout_s,
        help="seconds allowed for each workload pass",
    )
    parser.add_argument(
        "--startup-timeout",
        dest="startup_timeout_s",
        type=float,
        default=DemoOptions.startup_timeout_s,
        help="seconds each server may take to start (default: %(default)s)",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=DemoOptions.data_parallel_size,
        help="EngineCores of the guarded server (vLLM's --data-parallel-size; default: "
        "%(default)s); each has --num-gpu-blocks blocks",
    )
    parser.add_argument(
        "--metrics-trace",
        type=Path,
        default=None,
        metavar="FILE.json",
        help="save the guarded server's /metrics, sampled every second during the workload",
    )
    parser.add_argument(
        "--no-engine-proof",
        dest="engine_proof",
        action="store_false",
        help="skip the engine-level proof that opens the report (stock diverging, the guard "
        "matching) and run the server part only",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="where to generate (or find) the tiny model (default: a per-user cache directory)",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="where the servers' logs and the guard's stats files go (default: a new temporary "
        "directory); printed at start and in the report",
    )
    ns = parser.parse_args(argv)
    return DemoOptions(**vars(ns))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; exit status 0 if every completion matched, 1 on mismatches or failures."""
    options = _parse_args(argv)
    with _sigterm_as_exit():
        try:
            report = run_demo(options)
        except (ServerExited, TimeoutError, urllib.error.URLError) as exc:
            print(f"demo aborted: {exc}", file=sys.stderr)
            return 2
    print(report.render())
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
