"""Engine-level reproduction: a prefix-cache hit on KV that was never written.

The scheduler-level layout (``tests/test_preemption.py``, shared notes "Findings") scaled from
block size 16 to 32 and run on a real in-process ``LLMEngine`` with the tiny Llama model:

* 20 KV blocks of 32 tokens (``num_gpu_blocks_override=20``, the null block being one of them,
  exactly like the scheduler-level ``KVCacheConfig(num_blocks=20)``), priority policy,
  ``long_prefill_token_threshold=128``, ``max_num_batched_tokens=512``,
  ``scheduler_reserve_full_isl=False``;
* D (32 tokens, priority 0, 3 outputs) and A (320 tokens, priority 1) arrive; one step;
  B (240 tokens, priority 0) arrives; two steps. In the second, A is scheduled first and
  registers its blocks 9 and 10 (tokens 256-319), then B cannot allocate and A, already
  scheduled, is the victim. A's step is withdrawn, so those blocks are never written, but
  stock vLLM keeps their hashes;
* C arrives with A's prompt. On stock vLLM it hits 288 tokens, block 9 included, and attends
  over memory that holds no KV of its prompt; so does A when it resumes.

With the guard, A's registrations of the withdrawn step are rolled back when it is preempted:
C hits 256 tokens and recomputes the rest, and every completion matches an engine without
prefix caching. Measured on vLLM 0.32 (CPU, float32): stock C and A differ from the reference
from their first token on (top logprob off by 0.82 nat), the guard matches to within 1.2e-5.

Other platforms (``scripts/gpu_check.sh``) pass extra ``EngineArgs`` as JSON in
``VLLM_PREFIX_GUARD_E2E_ENGINE_ARGS`` (e.g. ``{"async_scheduling": true}``; vLLM's CPU backend
always schedules synchronously) and may widen the logprob tolerance with
``VLLM_PREFIX_GUARD_E2E_LOGPROB_ATOL``. The same arrivals reproduce the bug with async scheduling:
the project's shadow-KV scheduler driver with ``AsyncScheduler`` and two steps in flight shows
A preempted in the third ``schedule()`` call and C and A reading the never-written block.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from guard_demo.compare import (
    LOGPROB_ATOL,
    TOP_LOGPROBS,
    Completion,
    find_mismatches,
)
from guard_demo.workload import PROMPT_VOCAB
from vllm_prefix_guard import plugin
from vllm_prefix_guard.diagnostics.factory import SchedulerSpec
from vllm_prefix_guard.hooks import guard_of

pytestmark = pytest.mark.e2e

EXTRA_ENGINE_ARGS: dict[str, Any] = json.loads(
    os.environ.get("VLLM_PREFIX_GUARD_E2E_ENGINE_ARGS") or "{}"
)
ATOL = float(os.environ.get("VLLM_PREFIX_GUARD_E2E_LOGPROB_ATOL") or LOGPROB_ATOL)

#: The scheduler-level layout (block size 16) scaled to the tiny model's block size 32.
SCALE = 2
LAYOUT = SchedulerSpec(
    block_size=16 * SCALE,
    num_blocks=20,
    max_model_len=512,
    policy="priority",
    long_prefill_token_threshold=64 * SCALE,
    max_num_batched_tokens=256 * SCALE,
    reserve_full_isl=False,
)
OUTPUT_TOKENS = 8


def tokens(n16: int, offset: int) -> list[int]:
    """``n16`` tokens at block size 16, scaled; distinct per ``offset``, below the tiny model's
    special ids."""
    return [(offset * 7 + i * 13) % PROMPT_VOCAB for i in range(n16 * SCALE)]


def engine_args(model: Path, spec: SchedulerSpec) -> Any:
    """``EngineArgs`` for the tiny model with ``spec``'s scheduler and KV cache, and the
    platform's extra arguments on top. ``num_blocks`` counts the null block, as
    ``num_gpu_blocks_override`` does."""
    from vllm.engine.arg_utils import EngineArgs

    kwargs: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "seed": 0,
        "enforce_eager": True,
        "block_size": spec.block_size,
        "num_gpu_blocks_override": spec.num_blocks,
        "max_model_len": spec.max_model_len,
        "max_num_seqs": spec.max_num_seqs,
        "enable_prefix_caching": spec.enable_prefix_caching,
        "scheduling_policy": spec.policy,
        "long_prefill_token_threshold": spec.long_prefill_token_threshold,
        "max_num_batched_tokens": spec.max_num_batched_tokens,
        "scheduler_reserve_full_isl": spec.reserve_full_isl,
        "async_scheduling": spec.async_scheduling,
    }
    return EngineArgs(**{**kwargs, **EXTRA_ENGINE_ARGS})


@dataclass
class ScenarioRun:
    """What one engine did with the scenario."""

    completions: dict[str, Completion] = field(default_factory=dict)
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    #: Per ``schedule()`` call, the requests it preempted (external ids).
    preempted: list[set[str]] = field(default_factory=list)
    async_scheduling: bool = False
    #: The class names of the scheduler's pool, outermost first (vLLM's, or kvcached's, and
    #: the guard's on top when it grafted one).
    pool_mro: list[str] = field(default_factory=list)
    #: The guard's counters for this engine's scheduler, when it had a guard.
    guard_counters: dict[str, int] | None = None


def run_scenario(model: Path, *, prefix_caching: bool) -> ScenarioRun:
    """Drive the layout step by step on a fresh in-process engine."""
    from vllm import SamplingParams

    run = ScenarioRun()
    with _engine(model, prefix_caching=prefix_caching) as engine:
        core = engine.engine_core.engine_core  # InprocClient -> EngineCore
        run.async_scheduling = bool(core.vllm_config.scheduler_config.async_scheduling)
        pool = core.scheduler.kv_cache_manager.block_pool
        run.pool_mro = [c.__name__ for c in type(pool).__mro__]
        _trace_preemptions(core.scheduler, run.preempted)

        def add(name: str, prompt: list[int], priority: int, max_tokens: int) -> None:
            params = SamplingParams(
                temperature=0.0, max_tokens=max_tokens, logprobs=TOP_LOGPROBS, ignore_eos=True
            )
            engine.add_request(name, {"prompt_token_ids": prompt}, params, priority=priority)

        def step() -> None:
            for output in engine.step():
                if output.finished:
                    run.completions[output.request_id] = Completion.from_vllm_output(
                        output.outputs[0]
                    )
                    run.num_cached_tokens[output.request_id] = output.num_cached_tokens or 0

        a_prompt = tokens(160, offset=1)
        add("D", tokens(16, offset=3), priority=0, max_tokens=3)
        add("A", a_prompt, priority=1, max_tokens=OUTPUT_TOKENS)
        step()
        add("B", tokens(120, offset=2), priority=0, max_tokens=OUTPUT_TOKENS)
        step()
        step()
        add("C", a_prompt, priority=0, max_tokens=OUTPUT_TOKENS)
        while engine.has_unfinished_requests():
            step()
        guard = guard_of(core.scheduler)
        run.guard_counters = guard.counters() if guard is not None else None
    return run


@contextlib.contextmanager
def _engine(model: Path, *, prefix_caching: bool) -> Iterator[Any]:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.v1.engine.llm_engine import LLMEngine

    spec = replace(LAYOUT, enable_prefix_caching=prefix_caching)
    engine = LLMEngine.from_engine_args(engine_args(model, spec))
    try:
        yield engine
    finally:
        engine.engine_core.shutdown()
        del engine
        gc.collect()
        cleanup_dist_env_and_memory()


def _trace_preemptions(scheduler: Any, preempted: list[set[str]]) -> None:
    """Record the preempted requests of every ``schedule()`` call of this scheduler instance.

    Wraps the bound method on the instance only, so stock vLLM and the guard's class-level
    wrapper both run unchanged underneath.
    """
    schedule = scheduler.schedule

    def traced(*args: Any, **kwargs: Any) -> Any:
        output = schedule(*args, **kwargs)
        preempted.append({_external_id(r) for r in output.preempted_req_ids or ()})
        return output

    scheduler.schedule = traced


def _external_id(internal_id: str) -> str:
    # LLMEngine makes request ids unique with a random "-<hex>" suffix.
    return internal_id.partition("-")[0]


def _differences(run: ScenarioRun, reference: ScenarioRun) -> dict[str, str]:
    assert run.completions.keys() == reference.completions.keys() == {"A", "B", "C", "D"}
    return find_mismatches(run.completions, reference.completions, ATOL)


# -- fixtures: one engine run each, shared by the tests of this module ------------------------


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module", autouse=True)
def _in_process_engine(monkeypatch_module: pytest.MonkeyPatch) -> None:
    # Keep the EngineCore in this process, so its scheduler can be observed and so that the
    # guard applied here is the guard the engine runs.
    monkeypatch_module.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch_module.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch_module.delenv("VLLM_PREFIX_GUARD", raising=False)


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> ScenarioRun:
    """The scenario without prefix caching: what every completion must look like."""
    plugin.undo()
    return run_scenario(tiny_model, prefix_caching=False)


@pytest.fixture(scope="module")
def stock(tiny_model: Path) -> ScenarioRun:
    plugin.undo()
    assert not plugin.is_applied()
    return run_scenario(tiny_model, prefix_caching=True)


@pytest.fixture(scope="module")
def guarded(tiny_model: Path, monkeypatch_module: pytest.MonkeyPatch) -> Iterator[ScenarioRun]:
    """The scenario with the guard applied the way vLLM applies it: through ``register()``
    with ``VLLM_PREFIX_GUARD=1``."""
    plugin.undo()
    monkeypatch_module.setenv("VLLM_PREFIX_GUARD", "1")
    try:
        plugin.register()
        assert plugin.is_applied()
        yield run_scenario(tiny_model, prefix_caching=True)
    finally:
        plugin.undo()
        monkeypatch_module.delenv("VLLM_PREFIX_GUARD")


# -- tests -----------------------------------------------------------------------------------


def test_scenario_runs_as_laid_out(reference: ScenarioRun, stock: ScenarioRun) -> None:
    """A is preempted in the third ``schedule()`` call (the one where it was scheduled first),
    in every engine; and the requested scheduling mode took effect."""
    for run in (reference, stock):
        assert "A" in run.preempted[2], run.preempted[:4]
        assert run.async_scheduling == EXTRA_ENGINE_ARGS.get("async_scheduling", False)


def test_stock_prefix_caching_reads_unwritten_kv(
    reference: ScenarioRun, stock: ScenarioRun
) -> None:
    """Stock vLLM: C hits A's never-written block 9, and C and the resumed A diverge."""
    assert stock.num_cached_tokens["C"] == 9 * LAYOUT.block_size
    differences = _differences(stock, reference)
    assert {"A", "C"} <= differences.keys(), differences
    # B and D never touch A's blocks: proof that the tolerance is not what fails A and C.
    assert "B" not in differences and "D" not in differences, differences


def test_guard_matches_reference(reference: ScenarioRun, guarded: ScenarioRun) -> None:
    """With the guard, C hits only A's written blocks, and every completion matches."""
    assert "A" in guarded.preempted[2]
    assert guarded.num_cached_tokens["C"] == 8 * LAYOUT.block_size
    assert _differences(guarded, reference) == {}
