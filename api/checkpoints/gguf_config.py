"""The Hugging Face config of a GGUF file: transformers' reading of it, completed from llama.cpp's metadata.

`transformers` rebuilds a config from a GGUF's metadata, but for these families it reads only the
shape keys and leaves the rest at its config classes' defaults, which are one published checkpoint's
values: a Qwen3 file's `head_dim`, a Gemma 2 file's soft-caps, a Phi-3 file's LongRoPE (stored as two
tensors) and partial rotary width, any file's RoPE scaling. This module sets every field that changes
the math from the file itself, with llama.cpp's meaning of each key (and llama.cpp's rules where the
file states nothing, e.g. Gemma's attention scale), and refuses any architecture-specific key it does
not know, naming it, rather than converting a model that would compute something else.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

# GGUF `general.architecture` -> the HF `architectures` entry the converted checkpoint gets.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # transformers reads a llama file named "mistral..." as Mistral
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
_MISTRAL = "MistralForCausalLM"
# `{arch}.<key>` metadata this module understands; any other one is refused by name.
_SHAPE_KEYS = {
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "rope.freq_base", "rope.dimension_count",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
    "rope.scaling.finetuned",
}  # fmt: skip
_FAMILY_KEYS = {
    "gemma2": {"attention.sliding_window", "attn_logit_softcapping", "final_logit_softcapping"},
    "gemma3": {"attention.sliding_window", "rope.freq_base_swa"},
    "phi3": {"attention.sliding_window", "rope.scaling.attn_factor"},
}
# llama.cpp's layer counts of the 27B sizes, whose attention scale is 1/sqrt(hidden/heads), not
# 1/sqrt(head_dim) (llama-model.cpp, after gemma_pytorch's config).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# llama.cpp's fixed values for what a Gemma file does not state (it reads no pattern key for these two).
_GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
# The special token ids the file states; one it does not state is None, not the config class's default.
SPECIAL_IDS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}
# Tensors that carry config rather than weights; read here, not loaded into the model.
ROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight")
# (factor, low_freq_factor, high_freq_factor, original context) of the published Llama 3.x configs.
_LLAMA3_ROPE_CANDIDATES = ((8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (16.0, 1.0, 4.0, 8192))

TensorReader = Callable[[str], np.ndarray]


def f32(value: float) -> float:
    """The shortest decimal of a float32 metadata value (1e-06, not 9.999999974752427e-07): the same
    float32, so the same math, and the number the model's own config.json has."""
    return float(str(np.float32(value)))


def architecture_of(metadata: Mapping[str, Any], source: str) -> str:
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{source}: GGUF architecture {arch!r} unsupported; expected one of {sorted(ARCHITECTURES)} "
            f"(the supported families are listed in README.md)"
        )
    return arch


def complete_config(
    config: dict[str, Any],
    metadata: Mapping[str, Any],
    tensors: Mapping[str, tuple[int, ...]],
    read_tensor: TensorReader,
    *,
    source: str,
) -> dict[str, Any]:
    """`config` (transformers' GGUF config as a dict) with every math-changing field set from the file.

    `tensors` maps the file's tensor names to their shapes; `read_tensor` reads a small float tensor.
    """
    arch = architecture_of(metadata, source)
    key = lambda name, default=None: metadata.get(f"{arch}.{name}", default)  # noqa: E731
    known = _SHAPE_KEYS | _FAMILY_KEYS.get(arch, set())
    unknown = sorted(k for k in metadata if k.startswith(f"{arch}.") and k[len(arch) + 1 :] not in known)
    if unknown:
        raise ValueError(f"{source}: GGUF metadata {unknown} not understood; refusing to convert without it")
    out = dict(config)
    for gguf_key, name in SPECIAL_IDS.items():
        out[name] = metadata.get(gguf_key)
    out["architectures"] = [_MISTRAL if out.get("model_type") == "mistral" else ARCHITECTURES[arch]]
    heads = _int(key("attention.head_count"), f"{arch}.attention.head_count", source)
    head_dim = _head_dim(arch, key, out, heads, source)
    if (eps := key("attention.layer_norm_rms_epsilon")) is not None:
        out["rms_norm_eps"] = f32(eps)
    rope = {"rope_type": "default", "rope_theta": f32(key("rope.freq_base", 10000.0))}
    rope_dims = key("rope.dimension_count", head_dim)
    if arch == "phi3":
        rope["partial_rotary_factor"] = rope_dims / head_dim
    elif rope_dims != head_dim:
        raise ValueError(
            f"{source}: {arch}.rope.dimension_count={rope_dims} differs from the head size {head_dim}; "
            f"partial rotary embeddings exist only for phi3"
        )
    rope |= _rope_scaling(arch, key, tensors, read_tensor, head_dim, source)
    if arch == "gemma2" or arch == "gemma3":
        _gemma(arch, key, out, rope, heads, head_dim, source)
    else:
        out["rope_parameters"] = rope
    if out.get("model_type") == "mistral":  # llama.cpp's llama graph has no window; MistralConfig's is 4096
        out["sliding_window"] = None
    if arch == "phi3":
        out["sliding_window"] = key("attention.sliding_window")
        if rope["rope_type"] == "longrope":
            out["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    return out


def _int(value: Any, name: str, source: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(
            f"{source}: {name} must be one integer; found {value!r} (per-layer values unsupported)"
        )
    return value


def _head_dim(arch: str, key: Callable[..., Any], out: dict[str, Any], heads: int, source: str) -> int:
    """The head size the file states (`attention.key_length`), else hidden/heads as llama.cpp reads it."""
    hidden = _int(key("embedding_length"), f"{arch}.embedding_length", source)
    _int(key("attention.head_count_kv", heads), f"{arch}.attention.head_count_kv", source)
    head_dim = key("attention.key_length", hidden // heads)
    if key("attention.value_length", head_dim) != head_dim:
        raise ValueError(
            f"{source}: {arch}.attention.value_length={key('attention.value_length')} differs from "
            f"key_length={head_dim}; expected equal key and value head sizes"
        )
    head_dim = _int(head_dim, f"{arch}.attention.key_length", source)
    if arch == "phi3":  # Phi3Config has no head_dim: always hidden/heads
        if head_dim != hidden // heads:
            raise ValueError(f"{source}: phi3 head size {head_dim} must be hidden/heads={hidden // heads}")
    else:
        out["head_dim"] = head_dim
    return head_dim


def _rope_scaling(
    arch: str,
    key: Callable[..., Any],
    tensors: Mapping[str, tuple[int, ...]],
    read_tensor: TensorReader,
    head_dim: int,
    source: str,
) -> dict[str, Any]:
    """RoPE scaling keys of `rope_parameters`, from `rope.scaling.*` or the LongRoPE/llama3 tensors."""
    kind = key("rope.scaling.type", "none")
    factor = key("rope.scaling.factor")
    original = key("rope.scaling.original_context_length")
    if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
        if arch != "phi3" or kind not in ("none", "longrope"):
            raise ValueError(f"{source}: LongRoPE factor tensors in a {arch} file (rope type {kind!r})")
        return _longrope(key, read_tensor, original, source)
    if "rope_freqs.weight" in tensors:
        if arch != "llama" or kind != "none":
            raise ValueError(f"{source}: a rope_freqs tensor in a {arch} file (rope type {kind!r})")
        freqs = read_tensor("rope_freqs.weight")
        return _llama3_rope(freqs, key("rope.freq_base", 10000.0), head_dim, source)
    if key("rope.scaling.attn_factor", 1.0) != 1.0:
        raise ValueError(f"{source}: {arch}.rope.scaling.attn_factor without LongRoPE factors unsupported")
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return {}
    if kind == "linear":
        return {"rope_type": "linear", "factor": f32(factor)}
    if kind == "yarn" and factor is not None and original is not None:
        return {"rope_type": "yarn", "factor": f32(factor), "original_max_position_embeddings": int(original)}
    raise ValueError(
        f"{source}: {arch}.rope.scaling.type={kind!r} (factor {factor}, original context {original}) "
        f"unsupported; expected none, linear, or yarn with a factor and an original context length"
    )


def _longrope(
    key: Callable[..., Any], read_tensor: TensorReader, original: Any, source: str
) -> dict[str, Any]:
    """Phi-3's LongRoPE: llama.cpp stores the factors as tensors and the original context as a key."""
    if original is None:
        raise ValueError(f"{source}: LongRoPE factors without phi3.rope.scaling.original_context_length")
    rope: dict[str, Any] = {
        "rope_type": "longrope",
        "long_factor": [f32(v) for v in read_tensor("rope_factors_long.weight").tolist()],
        "short_factor": [f32(v) for v in read_tensor("rope_factors_short.weight").tolist()],
        "original_max_position_embeddings": int(original),
    }
    # transformers' default attention factor, from the context ratio; the file's only when it differs.
    ratio = key("context_length") / int(original)
    default = 1.0 if ratio <= 1.0 else math.sqrt(1 + math.log(ratio) / math.log(int(original)))
    attn_factor = key("rope.scaling.attn_factor")
    if attn_factor is not None and f32(attn_factor) != f32(default):
        rope["attention_factor"] = f32(attn_factor)
    return rope


def _llama3_rope(freqs: np.ndarray, base: float, head_dim: int, source: str) -> dict[str, Any]:
    """Llama 3.x RoPE scaling, which llama.cpp stores only as the per-frequency divisors it computes:
    the published parameter set that recomputes those divisors is the config; none matching is refused."""
    inv_freq = 1.0 / (np.float64(base) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / inv_freq
    for factor, low, high, original in _LLAMA3_ROPE_CANDIDATES:
        smooth = (original / wavelen - low) / (high - low)
        expected = np.where(
            wavelen < original / high,
            1.0,
            np.where(wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth)),
        )
        if expected.shape == freqs.shape and np.allclose(expected, freqs, rtol=1e-6, atol=0):
            return {
                "rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }  # fmt: skip
    raise ValueError(
        f"{source}: rope_freqs tensor (Llama 3 RoPE scaling) matches none of the published parameter sets "
        f"{_LLAMA3_ROPE_CANDIDATES} (factor, low, high, original context); refusing to guess"
    )


def _gemma(
    arch: str,
    key: Callable[..., Any],
    out: dict[str, Any],
    rope: dict[str, Any],
    heads: int,
    head_dim: int,
    source: str,
) -> None:
    """Gemma 2 / 3: attention scale, sliding-window layout, soft-caps and per-layer-type RoPE."""
    layers = out["num_hidden_layers"]
    hidden = out["hidden_size"]
    out["query_pre_attn_scalar"] = hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim
    window = key("attention.sliding_window")
    pattern = _GEMMA_SWA_PATTERN[arch]
    if window:  # llama.cpp: layer i slides when i % pattern < pattern - 1
        out["sliding_window"] = int(window)
        out["layer_types"] = [
            "sliding_attention" if i % pattern < pattern - 1 else "full_attention" for i in range(layers)
        ]
    else:
        out["sliding_window"] = None
        out["layer_types"] = ["full_attention"] * layers
    if arch == "gemma2":
        for name, default in _GEMMA2_SOFTCAPS.items():
            out[name] = f32(key(name, default))
        out["rope_parameters"] = rope
        return
    out["attn_logit_softcapping"] = out["final_logit_softcapping"] = None
    local = {"rope_type": "default", "rope_theta": f32(key("rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_BASE))}
    out["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
    out.pop("_sliding_window_pattern", None)
    out.pop("sliding_window_pattern", None)
