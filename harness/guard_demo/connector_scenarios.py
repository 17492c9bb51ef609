"""Failed KV-connector loads on a real engine, stock vLLM against the guard.

A first engine stores prompts through vLLM's ``ExampleConnector``. Later engines load
them back through :class:`~guard_demo.failing_connector.FailingExampleConnector`, whose
loads fail for their last ``FAIL_BLOCKS`` blocks (garbage left in them, the blocks
reported invalid) the first time each stored prefix is loaded. Every completion is
compared with an engine that has neither prefix caching nor a connector.

Each *shape* is a loader request L whose prompt is a stored prefix plus a short tail,
and a reader R with the same prefix and another tail:

``next-step``
    L loads and fails in step 1; R arrives for step 2. Under ``recompute`` stock vLLM
    keeps the invalid blocks hashed: R hits them while L is still recomputing them one
    chunk per step, and reads garbage. Under ``fail`` stock evicts them (control).
``aborted``
    As ``next-step``, but L is aborted while step 1 executes, as a client disconnect is
    handled by ``EngineCore.step``: after ``execute_model``, before
    ``update_from_output``. Stock vLLM scans only running requests for invalid blocks,
    so under either policy they stay hashed and R reads garbage.
``same-step-sharer``
    L and R arrive together: R hits L's blocks registered moments earlier in the same
    ``schedule()``. Under ``recompute`` stock lets R keep them as computed, trusting L
    to rewrite them before R reads them, which chunked prefill does not guarantee.
    Under ``fail`` both fail.
``async-next-step``
    As ``next-step`` with an asynchronous load (``WAITING_FOR_REMOTE_KVS``): vLLM
    registers nothing before the load is confirmed, so stock is expected to be right.

Run ``python -m guard_demo.connector_scenarios`` for the table of measured numbers;
``tests/e2e/test_kv_connector.py`` asserts on the same runs.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from guard_demo.compare import LOGPROB_ATOL, TOP_LOGPROBS, Completion, compare_completions
from guard_demo.in_process import external_id, in_process_engine
from guard_demo.workload import PROMPT_VOCAB, WorkItem

__all__ = [
    "BLOCK_SIZE",
    "FAIL_BLOCKS",
    "POLICIES",
    "SHAPES",
    "Divergence",
    "EngineRun",
    "Shape",
    "ShapeRun",
    "divergence",
    "failing_transfer_config",
    "run_failing",
    "run_reference",
    "server_workload",
    "store_prefixes",
    "store_prompts",
]

BLOCK_SIZE = 32
#: Stored prefix: 5 blocks. Prompts are prefix + ``TAIL_TOKENS``, so ``ExampleConnector``
#: matches (and stores) exactly the prefix: it keys a prompt of n tokens by its first
#: ``(n - 2) // 32 * 32`` tokens.
PREFIX_BLOCKS = 5
TAIL_TOKENS = 4
#: Trailing blocks of a failing load that fail. Two, so that L (recomputing one block
#: per step, ``CHUNK_TOKENS``) has not rewritten the last one when R first reads it.
FAIL_BLOCKS = 2
CHUNK_TOKENS = 32
OUTPUT_TOKENS = 6
NUM_GPU_BLOCKS = 64
POLICIES = ("recompute", "fail")
CONNECTOR_MODULE = "guard_demo.failing_connector"
CONNECTOR_CLASS = "FailingExampleConnector"


@dataclass(frozen=True)
class Shape:
    name: str
    seed: int
    #: L is aborted while its failing step executes.
    abort_loader: bool = False
    #: R arrives in the same step as L (else in the next).
    reader_same_step: bool = False
    #: The connector loads asynchronously for this shape.
    async_load: bool = False

    @property
    def loader(self) -> str:
        return f"{self.name}/L"

    @property
    def reader(self) -> str:
        return f"{self.name}/R"

    def prompts(self) -> dict[str, list[int]]:
        rng = random.Random(self.seed)
        prefix = [rng.randrange(PROMPT_VOCAB) for _ in range(PREFIX_BLOCKS * BLOCK_SIZE)]
        tails = [[rng.randrange(PROMPT_VOCAB) for _ in range(TAIL_TOKENS)] for _ in range(2)]
        return {self.loader: prefix + tails[0], self.reader: prefix + tails[1]}


SHAPES = (
    Shape("next-step", seed=11),
    Shape("aborted", seed=12, abort_loader=True),
    Shape("same-step-sharer", seed=13, reader_same_step=True),
    Shape("async-next-step", seed=14, async_load=True),
)


# -- engines ---------------------------------------------------------------------------


def engine_args(model: Path, **overrides: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    kwargs: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "seed": 0,
        "enforce_eager": True,
        "block_size": BLOCK_SIZE,
        "num_gpu_blocks_override": NUM_GPU_BLOCKS,
        "max_model_len": 512,
        "max_num_batched_tokens": 512,
        "long_prefill_token_threshold": CHUNK_TOKENS,
        "enable_prefix_caching": True,
    }
    kwargs.update(overrides)
    return EngineArgs(**kwargs)


def failing_transfer_config(
    storage: str | os.PathLike[str], policy: str, **extra: Any
) -> dict[str, Any]:
    """``--kv-transfer-config`` of an engine that loads through the failing connector."""
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {
            "shared_storage_path": str(storage),
            "fail_seed": 0,
            "fail_blocks": FAIL_BLOCKS,
            "fail_first_load_only": True,
            "store_prompts": False,
            **extra,
        },
    }


def _params() -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=OUTPUT_TOKENS, logprobs=TOP_LOGPROBS, ignore_eos=True
    )


# -- what a run gives ------------------------------------------------------------------


@dataclass
class ShapeRun:
    """One shape on one engine."""

    completions: dict[str, Completion] = field(default_factory=dict)
    #: Requests that finished with an error (policy ``fail``) or were aborted.
    not_completed: dict[str, str] = field(default_factory=dict)
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    #: The connector's loads: (request, external tokens, failing block ids).
    loads: list[tuple[str, int, list[int]]] = field(default_factory=list)
    #: The guard's counters over the shape (deltas); empty on stock vLLM.
    guard_counters: dict[str, int] = field(default_factory=dict)


@dataclass
class EngineRun:
    shapes: dict[str, ShapeRun] = field(default_factory=dict)
    build_s: float = 0.0
    run_s: float = 0.0


class _Driver:
    """Steps one engine through the shapes, one shape after the other."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.core = engine.engine_core.engine_core  # InprocClient -> EngineCore
        self.connector = self.core.scheduler.connector
        self._abort_armed: str | None = None
        self._current: ShapeRun | None = None
        self._wrap_execute_model()

    def _wrap_execute_model(self) -> None:
        executor = self.core.model_executor
        execute_model = executor.execute_model

        def traced(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            result = execute_model(scheduler_output, *args, **kwargs)
            name = self._abort_armed
            if name is not None and any(
                external_id(r) == name for r in scheduler_output.num_scheduled_tokens
            ):
                # What EngineCore's input thread does with a client's abort that arrives
                # while the step executes: step() processes it before update_from_output.
                self._abort_armed = None
                internal = self.engine.output_processor.abort_requests([name], internal=False)
                self.core.aborts_queue.put_nowait(internal)
                assert self._current is not None
                self._current.not_completed[name] = "aborted"
            return result

        executor.execute_model = traced

    def add(self, name: str, prompt: list[int]) -> None:
        self.engine.add_request(name, {"prompt_token_ids": prompt}, _params())

    def step(self) -> None:
        run = self._current
        assert run is not None
        for output in self.engine.step():
            if not output.finished:
                continue
            name = output.request_id
            completion = output.outputs[0]
            if completion.finish_reason not in ("length", "stop"):
                run.not_completed[name] = str(completion.finish_reason)
                continue
            run.completions[name] = Completion.from_vllm_output(completion)
            run.num_cached_tokens[name] = output.num_cached_tokens or 0

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()

    def run_shape(self, shape: Shape, counters: Callable[[], dict[str, int]]) -> ShapeRun:
        run = self._current = ShapeRun()
        before = counters()
        loads_before = len(self.connector.loads)
        self.connector.async_load = shape.async_load
        prompts = shape.prompts()
        if shape.abort_loader:
            self._abort_armed = shape.loader
        self.add(shape.loader, prompts[shape.loader])
        if shape.reader_same_step:
            self.add(shape.reader, prompts[shape.reader])
        self.step()
        if not shape.reader_same_step:
            self.add(shape.reader, prompts[shape.reader])
        self.drain()
        self.connector.async_load = False
        after = counters()
        run.guard_counters = {
            key: value - before.get(key, 0)
            for key, value in after.items()
            if value != before.get(key, 0)
        }
        run.loads = [
            (external_id(r), n, blocks) for r, n, blocks in self.connector.loads[loads_before:]
        ]
        self._current = None
        return run


# -- the three kinds of engine -----------------------------------------------------------


def store_prefixes(model: Path, storage: str | os.PathLike[str], shapes: Sequence[Shape]) -> float:
    """Store each shape's loader prompt (so its prefix); return the seconds it took."""
    return store_prompts(model, storage, [shape.prompts()[shape.loader] for shape in shapes])


def store_prompts(
    model: Path, storage: str | os.PathLike[str], prompts: Sequence[Sequence[int]]
) -> float:
    """Store ``prompts`` with vLLM's own ``ExampleConnector``; return the seconds it took.

    One prompt at a time and without chunking: ``ExampleConnector`` saves a prompt in the
    step that first schedules it, so that step must compute all of it.
    """
    from vllm.config import KVTransferConfig

    start = time.monotonic()
    transfer = KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(storage)},
    )
    args = engine_args(
        model,
        enable_prefix_caching=False,
        long_prefill_token_threshold=0,
        kv_transfer_config=transfer,
    )
    with in_process_engine(args) as engine:
        for index, prompt in enumerate(prompts):
            engine.add_request(f"store-{index}", {"prompt_token_ids": list(prompt)}, _params())
            while engine.has_unfinished_requests():
                engine.step()
    return time.monotonic() - start


def run_reference(model: Path, shapes: Sequence[Shape]) -> EngineRun:
    """Every request of every shape on an engine without prefix caching or connector."""
    start = time.monotonic()
    run = EngineRun()
    with in_process_engine(engine_args(model, enable_prefix_caching=False)) as engine:
        run.build_s = time.monotonic() - start
        for shape in shapes:
            for name, prompt in shape.prompts().items():
                engine.add_request(name, {"prompt_token_ids": prompt}, _params())
        completions: dict[str, Completion] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    completions[output.request_id] = Completion.from_vllm_output(output.outputs[0])
        for shape in shapes:
            run.shapes[shape.name] = ShapeRun(
                completions={n: completions[n] for n in (shape.loader, shape.reader)}
            )
    run.run_s = time.monotonic() - start - run.build_s
    return run


def run_failing(
    model: Path,
    storage: str | os.PathLike[str],
    policy: str,
    *,
    guard: bool,
    shapes: Sequence[Shape] = SHAPES,
) -> EngineRun:
    """The shapes on an engine whose connector loads fail, with or without the guard."""
    from vllm.config import KVTransferConfig

    from vllm_prefix_guard import plugin
    from vllm_prefix_guard.hooks import guard_of

    plugin.undo()
    if guard:
        plugin.apply()
    start = time.monotonic()
    run = EngineRun()
    try:
        transfer = KVTransferConfig(**failing_transfer_config(storage, policy))
        with in_process_engine(engine_args(model, kv_transfer_config=transfer)) as engine:
            run.build_s = time.monotonic() - start
            driver = _Driver(engine)
            scheduler_guard = guard_of(driver.core.scheduler)
            assert (scheduler_guard is not None) == guard, "the guard is on exactly when asked"

            def counters() -> dict[str, int]:
                return scheduler_guard.counters() if scheduler_guard is not None else {}

            for shape in shapes:
                run.shapes[shape.name] = driver.run_shape(shape, counters)
    finally:
        plugin.undo()
    run.run_s = time.monotonic() - start - run.build_s
    return run


# -- the server's workload --------------------------------------------------------------


def server_prefixes(count: int = 8, seed: int = 7) -> list[list[int]]:
    """The stored prefixes the server workload shares (``PREFIX_BLOCKS`` blocks each)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(PROMPT_VOCAB) for _ in range(PREFIX_BLOCKS * BLOCK_SIZE)]
        for _ in range(count)
    ]


def server_workload(
    prefixes: Sequence[Sequence[int]], seed: int = 0, wave_period_s: float = 0.6
) -> list[WorkItem]:
    """Concurrent requests that share the stored prefixes, one wave per prefix.

    A wave opens with the prefix's first request, whose load fails (the failing connector
    fails each prefix's first load, for 1 to 5 blocks drawn from the seed). Another
    request with that prefix arrives with it (a same-step sharer, when both land in one
    ``schedule()``) and one or two within the next 300 ms (readers while the loader still
    recomputes), plus one on an earlier prefix. Tails of 2 to 33 tokens keep every prompt
    keyed by its whole prefix in ``ExampleConnector``'s store. About one request in eight
    is cancelled early.
    """
    rng = random.Random(seed)
    items: list[WorkItem] = []

    def add(prefix: Sequence[int], arrival_s: float) -> None:
        tail = [rng.randrange(PROMPT_VOCAB) for _ in range(rng.randint(2, 33))]
        cancel = rng.uniform(0.02, 0.4) if rng.random() < 0.125 else None
        items.append(
            WorkItem(
                request_id=f"kv-{seed}-{len(items)}",
                prompt=tuple(prefix) + tuple(tail),
                priority=0,
                max_tokens=rng.randint(4, 16),
                arrival_s=round(arrival_s, 3),
                cancel_after_s=cancel,
            )
        )

    for wave, prefix in enumerate(prefixes):
        start = wave * wave_period_s
        add(prefix, start)
        add(prefix, start)
        for _ in range(rng.randint(1, 2)):
            add(prefix, start + rng.uniform(0.02, 0.3))
        if wave:
            add(prefixes[rng.randrange(wave)], start + rng.uniform(0.0, 0.3))
    return items


# -- comparison ------------------------------------------------------------------------


@dataclass(frozen=True)
class Divergence:
    """How one completion differs from its reference."""

    #: The first difference (compare.compare_completions), or None when it matches.
    problem: str | None
    #: Position of the first differing sampled token, or None.
    first_token_mismatch: int | None
    #: Largest logprob difference of a reference top-k token, over the positions up to
    #: and including the first token mismatch. A token missing from the actual top-k
    #: counts from the actual k-th logprob, so this is a lower bound there.
    max_logprob_delta: float


def divergence(actual: Completion, reference: Completion) -> Divergence:
    first_token = None
    delta = 0.0
    pairs = zip(actual.token_ids, reference.token_ids, strict=False)
    for position, (got, want) in enumerate(pairs):
        a, r = actual.top_logprobs[position], reference.top_logprobs[position]
        floor = min(a.values(), default=float("-inf"))
        for token, logprob in r.items():
            delta = max(delta, abs(a[token] - logprob) if token in a else logprob - floor)
        if got != want:
            first_token = position
            break
    return Divergence(compare_completions(actual, reference, LOGPROB_ATOL), first_token, delta)


def mismatches(run: ShapeRun, reference: ShapeRun) -> dict[str, Divergence]:
    """Completed requests of ``run`` that differ from the reference, by name."""
    out = {}
    for name, completion in run.completions.items():
        d = divergence(completion, reference.completions[name])
        if d.problem is not None:
            out[name] = d
    return out


# -- the report ------------------------------------------------------------------------


def measure(model: Path, shapes: Sequence[Shape] = SHAPES) -> dict[str, Any]:
    """Store, reference, then stock and guard per policy; the numbers as a dict."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kv-store-") as storage:
        store_s = store_prefixes(model, storage, shapes)
        reference = run_reference(model, shapes)
        runs = {
            (policy, guard): run_failing(model, storage, policy, guard=guard, shapes=shapes)
            for policy in POLICIES
            for guard in (False, True)
        }
    rows = []
    for policy in POLICIES:
        for shape in shapes:
            row: dict[str, Any] = {"shape": shape.name, "policy": policy}
            for guard in (False, True):
                shape_run = runs[policy, guard].shapes[shape.name]
                side = "guard" if guard else "stock"
                reference_run = reference.shapes[shape.name]
                row[side] = {
                    "completed": sorted(shape_run.completions),
                    "max_logprob_delta": max(
                        (
                            divergence(c, reference_run.completions[n]).max_logprob_delta
                            for n, c in shape_run.completions.items()
                        ),
                        default=0.0,
                    ),
                    "not_completed": shape_run.not_completed,
                    "num_cached_tokens": shape_run.num_cached_tokens,
                    "loads": shape_run.loads,
                    "mismatches": {
                        n: asdict(d) for n, d in mismatches(shape_run, reference_run).items()
                    },
                    "guard_counters": shape_run.guard_counters,
                }
            rows.append(row)
    timings = {
        "store_s": round(store_s, 1),
        "reference_build_s": round(reference.build_s, 1),
        "reference_run_s": round(reference.run_s, 1),
        **{
            f"{'guard' if g else 'stock'}_{p}_{k}": round(getattr(r, k), 1)
            for (p, g), r in runs.items()
            for k in ("build_s", "run_s")
        },
        "total_s": round(time.monotonic() - started, 1),
    }
    return {"rows": rows, "timings": timings}


def format_table(report: Mapping[str, Any]) -> str:
    lines = [
        "| shape | policy | stock: mismatches (first token diff, max logprob delta) "
        "| guard: mismatches | guard: rolled back (failed load) / sharers preempted "
        "| not completed (stock / guard) |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        stock, guard = row["stock"], row["guard"]

        def describe(side: Mapping[str, Any]) -> str:
            found = side["mismatches"]
            if not found:
                return f"0 of {len(side['completed'])} (max delta {side['max_logprob_delta']:.2g})"
            parts = [
                f"{name} (pos {d['first_token_mismatch']}, {d['max_logprob_delta']:.3g})"
                for name, d in found.items()
            ]
            return f"{len(found)} of {len(side['completed'])}: " + ", ".join(parts)

        counters = guard["guard_counters"]
        lines.append(
            f"| {row['shape']} | {row['policy']} | {describe(stock)} | {describe(guard)} "
            f"| {counters.get('rolled_back_kv_load_failure', 0)} / "
            f"{counters.get('dependents_preempted', 0)} "
            f"| {_names(stock['not_completed'])} / {_names(guard['not_completed'])} |"
        )
    return "\n".join(lines)


def _names(not_completed: Mapping[str, str]) -> str:
    return ", ".join(f"{n.split('/')[-1]}:{why}" for n, why in not_completed.items()) or "-"


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from guard_demo.tiny_model import default_model_dir, generate_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    report = measure(generate_tiny_model(default_model_dir()))
    print(format_table(report))
    print(json.dumps(report["timings"]))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
