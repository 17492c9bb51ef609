"""An offline Hugging Face Hub cache holding only the ``config.json`` files vLLM's tests need.

vLLM's scheduler, KV-cache and KV-connector unit tests build a ``ModelConfig`` for a Hub
model id (``facebook/opt-125m`` mostly) and read nothing but its ``config.json``. With
``HF_HUB_OFFLINE=1`` the Hub client resolves a file from the cache layout

    HF_HUB_CACHE/models--ORG--NAME/refs/main            -> <revision>
    HF_HUB_CACHE/models--ORG--NAME/snapshots/<revision>/config.json

so writing that layout is enough: no weights, no tokenizer, no network. The configs
below are written by hand, trimmed to what ``transformers``' config classes and vLLM's
``ModelConfig`` read (architecture, sizes, dtype, context length).

Usage:
    python hub_cache.py HF_HOME        # writes HF_HOME/hub/...; prints the hub cache path
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    # create_scheduler()/create_vllm_config() in tests/v1/core/utils.py and
    # tests/v1/kv_connector/unit/utils.py, and most kv_connector tests.
    "facebook/opt-125m": {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "activation_function": "relu",
        "bos_token_id": 2,
        "do_layer_norm_before": True,
        "eos_token_id": 2,
        "ffn_dim": 3072,
        "hidden_size": 768,
        "max_position_embeddings": 2048,
        "num_attention_heads": 12,
        "num_hidden_layers": 12,
        "pad_token_id": 1,
        "torch_dtype": "float16",
        "vocab_size": 50272,
        "word_embed_proj_dim": 768,
    },
    # test_priority_preemption_bug.py, and test_nixl_connector.py's compatibility hash.
    "facebook/opt-350m": {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "activation_function": "relu",
        "bos_token_id": 2,
        "do_layer_norm_before": False,
        "eos_token_id": 2,
        "ffn_dim": 4096,
        "hidden_size": 1024,
        "max_position_embeddings": 2048,
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "pad_token_id": 1,
        "torch_dtype": "float16",
        "vocab_size": 50272,
        "word_embed_proj_dim": 512,
    },
    # ModelConfig()'s default model (vLLM 0.33): every bare ModelConfig()/VllmConfig().
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # test_scheduler.py: encoder-input (multimodal) scheduling.
    "llava-hf/llava-1.5-7b-hf": {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "ignore_index": -100,
        "image_token_index": 32000,
        "pad_token_id": 32001,
        "projector_hidden_act": "gelu",
        "text_config": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-05,
            "torch_dtype": "float16",
            "vocab_size": 32064,
        },
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 1024,
            "image_size": 336,
            "intermediate_size": 4096,
            "num_attention_heads": 16,
            "num_hidden_layers": 24,
            "patch_size": 14,
            "projection_dim": 768,
            "vocab_size": 32000,
        },
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "vocab_size": 32064,
    },
    # test_priority_scheduler_random.py.
    "Qwen/Qwen2.5-VL-3B-Instruct": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "vision_token_id": 151654,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "max_position_embeddings": 128000,
        "max_window_layers": 70,
        "num_attention_heads": 16,
        "num_hidden_layers": 36,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_sliding_window": False,
        "vision_config": {
            "depth": 32,
            "hidden_act": "silu",
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "in_chans": 3,
            "out_hidden_size": 2048,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "tokens_per_second": 2,
            "temporal_patch_size": 2,
        },
        "vocab_size": 151936,
    },
    # test_kv_cache_utils.py / test_kv_cache_planning.py: test_estimate_max_model_len.
    "Qwen/Qwen1.5-7B": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # test_scheduler.py: a hybrid (linear-attention + full-attention) model.
    "Qwen/Qwen3-Next-80B-A3B-Instruct": {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "decoder_sparse_step": 1,
        "full_attention_interval": 4,
        "head_dim": 256,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "intermediate_size": 5120,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "moe_intermediate_size": 512,
        "norm_topk_prob": True,
        "num_attention_heads": 16,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "num_hidden_layers": 48,
        "num_key_value_heads": 2,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000000,
        "shared_expert_intermediate_size": 512,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 151936,
    },
}


def revision(model_id: str) -> str:
    """A stable 40-hex snapshot name per model and config (no real commit exists)."""
    payload = model_id + json.dumps(MODEL_CONFIGS[model_id], sort_keys=True)
    return hashlib.sha1(payload.encode()).hexdigest()


def write_hub_cache(hf_home: Path, model_ids: list[str] | None = None) -> Path:
    """Write ``config.json`` for ``model_ids`` (default: all) under ``hf_home/hub``.

    Returns:
        The hub cache directory, to export as ``HF_HUB_CACHE`` (``HF_HOME`` is its parent).
    """
    hub = Path(hf_home) / "hub"
    for model_id in model_ids or list(MODEL_CONFIGS):
        repo = hub / ("models--" + model_id.replace("/", "--"))
        rev = revision(model_id)
        snapshot = repo / "snapshots" / rev
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(json.dumps(MODEL_CONFIGS[model_id], indent=1))
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(rev)
    return hub


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(write_hub_cache(Path(sys.argv[1])))
