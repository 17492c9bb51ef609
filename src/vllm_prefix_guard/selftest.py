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


def make_scheduler() -> Any:
    """vLLM's ``Scheduler`` for the layout: one full-attention group, no tensors."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_dir = Path(tempfile.mkdtemp(prefix="vllm-prefix-guard-self-test-"))
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    configs = {
        "model_config": ModelConfig(
            model=str(model_dir), skip_tokenizer_init=True, dtype="float16", max_model_len=4096
        ),
        "scheduler_config": SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=256,
            max_model_len=4096,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
            policy="priority",
            long_prefill_token_threshold=64,
        ),
        "cache_config": CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
    }
    try:
        vllm_config = VllmConfig(**configs)
    except RuntimeError:  # a GPU wheel without a GPU infers no device; none is touched
        from vllm.config import DeviceConfig

        vllm_config = VllmConfig(**configs, device_config=DeviceConfig(device="cuda"))
    vllm_config.scheduler_config.async_scheduling = False  # the CPU platform's setting
    vllm_config.cache_config.num_gpu_blocks = 20
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=20, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)]
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


class Runner:
    """Computes each step it is given: records which prefix each block it fills holds,
    and samples token 7 for every request whose known tokens are all computed."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.block_contents: dict[int, Any] = {}  # block ID -> the key of what it holds

    def run(self, scheduler_output: Any) -> Any:
        import dataclasses

        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids, sampled = [], []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            (block_ids,) = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            computed = request.num_computed_tokens  # after this step (schedule() advanced)
            first = (computed - num_tokens) // BLOCK_SIZE
            for i in range(first, min(computed // BLOCK_SIZE, len(request.block_hashes))):
                key = make_block_hash_with_group_id(request.block_hashes[i], 0)
                self.block_contents[block_ids[i]] = key
            req_ids.append(req_id)
            sampled.append([7] if computed >= request.num_tokens else [])
        fields: dict[str, Any] = {"req_ids": req_ids, "sampled_token_ids": sampled}
        if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
            fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}  # vLLM < 0.34
        return ModelRunnerOutput(**fields)

    def entries_never_written(self) -> int:
        """Cached blocks whose hash names tokens no step that ran wrote into them."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return sum(
            1
            for block in pool.blocks
            if block.block_hash is not None
            and self.block_contents.get(block.block_id) != block.block_hash
        )


def zombie_layout() -> int:
    """Entries naming never-written KV, summed over the layout's steps, on whatever vLLM
    (stock or guarded) is active."""
    scheduler = make_scheduler()
    runner = Runner(scheduler)
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
        scheduler.update_from_output(scheduler_output, runner.run(scheduler_output))
        never_written += runner.entries_never_written()
    return never_written
