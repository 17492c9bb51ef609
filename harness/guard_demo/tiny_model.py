"""A deterministic tiny Llama checkpoint for end-to-end tests, built locally without a model hub.

The model is random but not *flat*: weights are scaled so that attention is sharp and the logits
spread over several nats. That matters for this project. A prefix-cache hit on a block that was
never written replaces 32 positions of K/V with stale memory; with HF's default initialisation
(std 0.02) the next-token distribution is nearly uniform and such a corruption moves logprobs by
less than the noise of a different batch shape. With the scales below it moves them by tenths of
a nat, while batch-shape noise in float32 stays around 1e-6.

Only ``numpy``, ``safetensors`` and ``tokenizers`` are needed (all installed with vLLM). The
checkpoint is float32: vLLM's CPU backend runs it fast enough at this size, and float32 keeps the
reference comparison far from rounding noise.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "TINY_LLAMA",
    "TinyLlamaSpec",
    "default_model_dir",
    "generate_tiny_model",
    "weights_digest",
    "write_checkpoint",
    "write_tokenizer",
]

#: Bumped whenever the generator changes what it writes, so cached checkpoints are rebuilt.
_GENERATOR_VERSION = 1
_STAMP_FILE = "tiny_model_stamp.json"
_BOS, _EOS = "<|bos|>", "<|eos|>"


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shape of the generated model.

    ``head_dim`` is 64 because vLLM's CPU attention kernels only support a few head sizes, and
    ``vocab_size`` equals the tokenizer's size so that every sampled id detokenizes.
    """

    num_hidden_layers: int = 2
    hidden_size: int = 256
    intermediate_size: int = 512
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5


TINY_LLAMA = TinyLlamaSpec()


def default_model_dir() -> Path:
    """Where :func:`generate_tiny_model` caches the checkpoint unless told otherwise.

    ``VLLM_PREFIX_GUARD_TINY_MODEL_DIR`` overrides it, so CI can point at a cached directory.
    """
    override = os.environ.get("VLLM_PREFIX_GUARD_TINY_MODEL_DIR")
    if override:
        return Path(override)
    cache_root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache_root / "vllm-prefix-guard" / "tiny-llama"


def generate_tiny_model(
    path: str | os.PathLike[str], seed: int = 0, spec: TinyLlamaSpec = TINY_LLAMA
) -> Path:
    """Write a tiny Llama checkpoint (config, weights, tokenizer) to ``path``, or reuse it.

    The directory is reused when its stamp matches ``(spec, seed, generator version)``, so repeated
    test sessions pay the cost (well under a second) only once. The files are written into a
    temporary sibling directory and renamed into place, so a concurrent or interrupted writer
    never leaves a half-written checkpoint behind a valid stamp.

    Args:
        path: Target directory.
        seed: Seed for the weights; the same seed always gives byte-identical weights.
        spec: Model shape.

    Returns:
        ``path`` as a :class:`~pathlib.Path`, ready for ``LLM(model=...)`` or ``vllm serve``.
    """

    def write(staging: Path) -> None:
        _write_config(staging, spec)
        _write_weights(staging, spec, seed)
        write_tokenizer(staging, spec)

    return write_checkpoint(Path(path), _stamp(spec, seed), write)


def write_checkpoint(target: Path, stamp: object, write: Callable[[Path], None]) -> Path:
    """``target`` as ``write`` fills it, unless it already holds a checkpoint stamped
    ``stamp``: written into a staging directory beside it, stamped, then renamed into place
    (so a reader never sees half a checkpoint, and two processes racing write one)."""
    if _read_stamp(target) == stamp:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    write(staging)
    (staging / _STAMP_FILE).write_text(json.dumps(stamp, sort_keys=True))
    _replace_dir(staging, target)
    return target


def _stamp(spec: TinyLlamaSpec, seed: int) -> dict[str, object]:
    return {"generator_version": _GENERATOR_VERSION, "seed": seed, "spec": asdict(spec)}


def _read_stamp(target: Path) -> object:
    try:
        return json.loads((target / _STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None


def _replace_dir(staging: Path, target: Path) -> None:
    """Move ``staging`` to ``target``; a stale ``target`` is moved aside first, then deleted.

    Only an empty directory or an earlier tiny checkpoint (it has a stamp) counts as stale:
    a mistyped path must not cost someone a directory.
    """
    if target.exists() and any(target.iterdir()) and not (target / _STAMP_FILE).exists():
        shutil.rmtree(staging, ignore_errors=True)
        raise FileExistsError(f"{target} exists and is not a tiny model; not overwriting it")
    if target.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
        target.rename(trash / target.name)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        staging.rename(target)
    except OSError:
        # Another process won the race and wrote an identical checkpoint.
        shutil.rmtree(staging, ignore_errors=True)


def _write_config(out: Path, spec: TinyLlamaSpec) -> None:
    bos_id, eos_id = spec.vocab_size - 2, spec.vocab_size - 1
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "initializer_range": 0.02,
        "rope_scaling": None,
        **asdict(spec),
    }
    generation_config = {"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": False}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2))


def _write_weights(out: Path, spec: TinyLlamaSpec, seed: int) -> None:
    """Random weights whose scales keep activations O(1) and attention and logits peaked.

    Each projection is drawn with std ``gain / sqrt(fan_in)``: gain 1 keeps the residual stream at
    unit scale, and the larger gains on Q/K (sharp attention, so every cached position matters)
    and on the LM head (logits spread over several nats) make wrong KV visible in logprobs.
    """
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    h, kv = spec.hidden_size, spec.num_key_value_heads * spec.head_dim
    q_out = spec.num_attention_heads * spec.head_dim

    def dense(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        std = gain / np.sqrt(cols)
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    tensors: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((spec.vocab_size, h)).astype(np.float32),
    }
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}"
        tensors[f"{p}.input_layernorm.weight"] = np.ones(h, dtype=np.float32)
        tensors[f"{p}.post_attention_layernorm.weight"] = np.ones(h, dtype=np.float32)
        tensors[f"{p}.self_attn.q_proj.weight"] = dense(q_out, h, gain=2.0)
        tensors[f"{p}.self_attn.k_proj.weight"] = dense(kv, h, gain=2.0)
        tensors[f"{p}.self_attn.v_proj.weight"] = dense(kv, h)
        tensors[f"{p}.self_attn.o_proj.weight"] = dense(h, q_out)
        tensors[f"{p}.mlp.gate_proj.weight"] = dense(spec.intermediate_size, h)
        tensors[f"{p}.mlp.up_proj.weight"] = dense(spec.intermediate_size, h)
        tensors[f"{p}.mlp.down_proj.weight"] = dense(h, spec.intermediate_size)
    tensors["model.norm.weight"] = np.ones(h, dtype=np.float32)
    tensors["lm_head.weight"] = dense(spec.vocab_size, h, gain=3.0)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def write_tokenizer(out: Path, spec: TinyLlamaSpec) -> None:
    """A byte-level BPE tokenizer with exactly ``spec.vocab_size`` tokens.

    The vocabulary is the 256 byte symbols, then fixed merges (space + letter, then letter pairs
    in lexicographic order) up to ``vocab_size - 2``, then BOS and EOS. It is built from
    constants rather than trained, so it is deterministic by construction.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    candidates = [("Ġ", c) for c in letters] + [(a, b) for a in letters for b in letters]
    for left, right in candidates[: spec.vocab_size - 2 - len(vocab)]:
        merges.append((left, right))
        vocab[left + right] = len(vocab)

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(_BOS, special=True), AddedToken(_EOS, special=True)])
    if tokenizer.get_vocab_size() != spec.vocab_size:
        raise AssertionError(f"tokenizer has {tokenizer.get_vocab_size()} tokens")
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _BOS,
        "eos_token": _EOS,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    special = {"bos_token": _BOS, "eos_token": _EOS}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def weights_digest(path: str | os.PathLike[str]) -> str:
    """SHA-256 of the weights file; lets tests assert the generator is deterministic."""
    return hashlib.sha256((Path(path) / "model.safetensors").read_bytes()).hexdigest()


if __name__ == "__main__":
    import sys

    # python harness/guard_demo/tiny_model.py [DIR]: the quick-start's model, no hub needed.
    print(generate_tiny_model(sys.argv[1] if len(sys.argv) > 1 else default_model_dir()))
