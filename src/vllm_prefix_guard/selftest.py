"""``doctor --self-test``: the known failure, on the installed vLLM, stock and guarded.

A real ``Scheduler`` (priority policy, 20 blocks of 16 tokens) runs the shared notes'
layout with a runner that computes what it is given: D and A (160 tokens, lower priority)
run; B arrives, so in the next step A is scheduled first, registers the blocks it is about
to compute, then is preempted for B; C with A's prompt arrives later. The judge is what a
prefix-cache entry promises: after each step's output comes back, every cached block must
hold the tokens its hash names, i.e. a step that ran wrote them. Stock vLLM keeps A's
entries of the step it never ran (C and the resumed A hit them); the guard removes them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Any

BLOCK_SIZE = 16
#: A config.json with a registered architecture is all ``ModelConfig`` needs without a
#: tokenizer: no weights, no hub.
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 8192,
    "torch_dtype": "float16",
}


@functools.cache
def model_dir() -> str:
    """The tiny Llama's directory (its ``config.json`` only), made once per process."""
    path = Path(tempfile.gettempdir()) / "vllm-prefix-guard-scheduler-model"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(path)


def make_vllm_config(**configs: Any) -> Any:
    """``VllmConfig(**configs)``; the GPU wheel on a GPU-less machine cannot infer a device,
    and the scheduler never touches it, so name one."""
    from vllm.config import DeviceConfig, VllmConfig

    try:
        return VllmConfig(**configs)
    except RuntimeError as exc:
        if "device" not in str(exc).lower():
            raise
        return VllmConfig(**configs, device_config=DeviceConfig(device="cuda"))


def model_runner_output(req_ids: list[str], **fields: Any) -> Any:
    """A ``ModelRunnerOutput`` listing ``req_ids`` in batch order, as a runner returns it
    (vLLM 0.30-0.33 also take each one's index, ``req_id_to_index``; 0.34 reads the order)."""
    from vllm.v1.outputs import ModelRunnerOutput

    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        fields["req_id_to_index"] = {req_id: i for i, req_id in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, **fields)


def make_scheduler() -> Any:
    """vLLM's ``Scheduler`` for the layout: one full-attention group, no tensors."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    vllm_config = make_vllm_config(
        model_config=ModelConfig(
            model=model_dir(), skip_tokenizer_init=True, dtype="float16", max_model_len=4096
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=256,
            max_model_len=4096,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
            policy="priority",
            long_prefill_token_threshold=64,
        ),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
    )
    vllm_config.scheduler_config.async_scheduling = False  # the CPU platform's setting
    vllm_config.cache_config.num_gpu_blocks = 20
    kv = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(
        num_blocks=20, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], kv)]
    )
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=False,
    )


def make_request(request_id: str, prompt: list[int], priority: int = 0) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=4, ignore_eos=True),
        pooling_params=None,
        priority=priority,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def run_step(scheduler: Any, scheduler_output: Any, written: dict[int, Any]) -> Any:
    """The runner: compute ``scheduler_output``'s tokens, recording in ``written`` (block ID
    -> key) which prefix each block it fills holds, and sample token 7 for every request
    whose known tokens are all computed."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    req_ids, sampled = [], []
    for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
        request = scheduler.requests[req_id]
        (block_ids,) = scheduler.kv_cache_manager.get_block_ids(req_id)
        computed = request.num_computed_tokens  # after this step (schedule() advanced)
        first = (computed - num_tokens) // BLOCK_SIZE
        for i in range(first, min(computed // BLOCK_SIZE, len(request.block_hashes))):
            written[block_ids[i]] = make_block_hash_with_group_id(request.block_hashes[i], 0)
        req_ids.append(req_id)
        sampled.append([7] if computed >= request.num_tokens else [])
    return model_runner_output(req_ids, sampled_token_ids=sampled)


def entries_never_written(scheduler: Any, written: dict[int, Any]) -> int:
    """Cached blocks whose hash names tokens no step that ran wrote into them."""
    return sum(
        block.block_hash is not None and written.get(block.block_id) != block.block_hash
        for block in scheduler.kv_cache_manager.block_pool.blocks
    )


def zombie_layout() -> int:
    """Entries naming never-written KV, summed over the layout's steps, on whatever vLLM
    (stock or guarded) is active."""
    scheduler = make_scheduler()
    written: dict[int, Any] = {}  # block ID -> the key of what a step that ran wrote there
    a_prompt = list(range(1, 161))
    scheduler.add_request(make_request("D", list(range(1000, 1016))))
    scheduler.add_request(make_request("A", a_prompt, priority=1))
    never_written = 0
    for iteration in range(100):
        if iteration == 1:
            scheduler.add_request(make_request("B", list(range(2000, 2120))))
        if iteration == 3:
            scheduler.add_request(make_request("C", a_prompt, priority=1))
        if iteration > 3 and not scheduler.has_requests():
            break
        scheduler_output = scheduler.schedule()
        scheduler.update_from_output(
            scheduler_output, run_step(scheduler, scheduler_output, written)
        )
        never_written += entries_never_written(scheduler, written)
    return never_written
