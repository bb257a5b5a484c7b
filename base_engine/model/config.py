"""The base model's configuration, from a Hugging Face checkpoint's config.json and generation_config.json.

Follows the `transformers` config format for LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
Qwen3ForCausalLM and Phi3ForCausalLM (its RoPE fields in phi3.py), both as published checkpoints write
it (`rope_theta` + `rope_scaling` with `rope_type` or the legacy `type` key, `torch_dtype`) and as
`transformers` 5 writes it (`rope_parameters`, `dtype`). Anything the engine could not reproduce exactly
(another activation, dynamic/long RoPE, quantized weights, per-layer sliding windows) is refused here
with the file and field named, never approximated; so is an architecture we do not serve, with the piece
it lacks (unsupported.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from adapters.types import BaseModelShapes, MoeShapes
from base_engine.model.compressed_tensors import CheckpointInt8, checkpoint_quantization
from base_engine.model.gemma_config import GEMMA_ACTIVATION, GEMMA_ARCHITECTURES, GemmaText, gemma_text
from base_engine.model.moe_config import MOE_ARCHITECTURES, MoeConfig, moe_config, moe_sliding_window
from base_engine.model.phi3 import phi3_rope_fields
from base_engine.model.unsupported import MODEL_TABLE, architecture_refusal

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Phi3ForCausalLM": "phi3",
    "Qwen3ForCausalLM": "qwen3",
    **GEMMA_ARCHITECTURES,
    **MOE_ARCHITECTURES,
}
# RoPE variants whose inverse frequencies are fixed at load time (rope.py reproduces them exactly).
# "dynamic" and "longrope" change frequencies with the sequence length at run time: refused, except
# LongRoPE on Phi-3 (model/phi3.py), whose two frequency sets the engine switches per sequence.
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
LONGROPE = "longrope"
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# transformers' defaults for fields a config.json may leave out, per model_type.
_DEFAULT_MAX_POSITIONS = {
    "llama": 2048,
    "mistral": 4096 * 32,
    "qwen2": 32768,
    "qwen3": 32768,
    "phi3": 4096,
    "qwen3_moe": 32768,
    "qwen2_moe": 32768,
    "mixtral": 4096 * 32,
}  # Gemma: gemma_config
# Qwen3's head_dim defaults to 128 whatever hidden/heads is; the others derive it.
_DEFAULT_HEAD_DIM = {"qwen3": 128}
_T = TypeVar("_T")
_YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding settings (Su et al. 2021, "RoFormer"), with the scaling variants HF names."""

    rope_type: str  # "default" | "linear" | "llama3" | "yarn" | "longrope"
    theta: float
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int | None = None  # llama3 / yarn: the pre-training context
    extra: dict[str, Any] = field(default_factory=dict, hash=False)  # yarn: beta_fast, beta_slow, mscale...
    partial_rotary_factor: float = 1.0  # rotate only the first int(head_dim * factor) dims of each head
    # longrope: frequency divisors while a sequence fits the original context, and once it is longer
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0  # longrope: cos and sin are multiplied by it (both factor sets)

    def __post_init__(self) -> None:
        known = (*SUPPORTED_ROPE_TYPES, LONGROPE)
        if self.rope_type not in known:
            raise ValueError(f"rope_type {self.rope_type!r} not supported; expected one of {known}")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1]")
        if self.partial_rotary_factor != 1 and self.rope_type not in ("default", LONGROPE):
            raise ValueError(f"partial rotary with rope_type {self.rope_type!r} unsupported")
        if self.rope_type == LONGROPE and (
            self.original_max_position_embeddings is None or not self.short_factor or not self.long_factor
        ):
            raise ValueError("longrope needs short_factor, long_factor and original_max_position_embeddings")
        if not self.theta > 0 or not self.factor > 0:
            raise ValueError(f"rope theta={self.theta} and factor={self.factor} must be > 0")
        if self.rope_type in ("llama3", "yarn") and self.original_max_position_embeddings is None:
            raise ValueError(f"rope_type {self.rope_type!r} needs original_max_position_embeddings")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"llama3 rope needs high_freq_factor > low_freq_factor; got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )

    def rotary_dim(self, head_dim: int) -> int:
        """How many leading dims of each head rotate (transformers: int(head_dim * partial_rotary_factor))."""
        return int(head_dim * self.partial_rotary_factor)

    @property
    def long_factor_after(self) -> int | None:
        """LongRoPE: a sequence with more tokens than this uses the long factors (None: one factor set)."""
        return self.original_max_position_embeddings if self.rope_type == LONGROPE else None


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the engine needs to build and load a Llama-family decoder."""

    architecture: str  # "LlamaForCausalLM" | "MistralForCausalLM" | "Qwen2ForCausalLM"
    model_type: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    attention_bias: bool  # bias on q/k/v (Qwen2 always; Llama and Qwen3 from `attention_bias`)
    o_proj_bias: bool  # Llama's and Qwen3's `attention_bias` also biases o_proj; Qwen2's does not
    mlp_bias: bool
    tie_word_embeddings: bool
    sliding_window: int | None  # effective window for every layer; None = full attention
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: torch.dtype
    # q/k norm: an RMSNorm over head_dim on every query and key head, after the projection and
    # before RoPE (Qwen3's q_norm / k_norm, weights `self_attn.{q,k}_norm.weight`).
    qk_norm: bool = False
    # Gemma 2 / 3 (gemma_config.py); the defaults are the Llama family's behaviour.
    hidden_act: str = "silu"  # or "gelu_pytorch_tanh": GeGLU with the tanh-approximated GELU
    # The Gemma decoder: RMSNorm scaling by (1 + weight) in fp32, norms before and after both attention
    # and MLP, embeddings times sqrt(hidden_size) (rounded to the model dtype).
    gemma_layout: bool = False
    layer_windows: tuple[int | None, ...] | None = None  # per layer (Gemma); None: sliding_window everywhere
    local_rope: RopeConfig | None = None  # RoPE of the sliding-window layers, when not `rope` (Gemma 3)
    query_pre_attn_scalar: float | None = None  # scores scaled by its **-0.5; None: head_dim**-0.5
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap) before softmax
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    has_vision_tower: bool = False  # a multimodal checkpoint whose text model alone is served
    moe: MoeConfig | None = None  # routed experts (moe_config.py); None: a dense MLP on every layer
    # A compressed-tensors int8 checkpoint (compressed_tensors.py); None: float weights.
    int8_checkpoint: CheckpointInt8 | None = None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: full attention)."""
        return self.sliding_window if self.layer_windows is None else self.layer_windows[layer]

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.num_key_value_heads <= 0 or self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a positive multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window={self.sliding_window} must be > 0 or None")
        if self.layer_windows is not None:
            windows = {w for w in self.layer_windows if w is not None}
            if len(self.layer_windows) != self.num_hidden_layers or self.sliding_window is not None:
                raise ValueError("layer_windows needs one entry per layer and sliding_window=None")
            if len(windows) > 1 or any(w <= 0 for w in windows):
                raise ValueError(f"layer_windows={self.layer_windows}: expected one window size > 0 and None")
        if self.hidden_act not in ("silu", GEMMA_ACTIVATION):
            raise ValueError(f"hidden_act={self.hidden_act!r}, expected 'silu' or {GEMMA_ACTIVATION!r}")

    def base_shapes(self) -> BaseModelShapes:
        return BaseModelShapes(
            model_type=self.model_type,
            num_layers=self.num_hidden_layers,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            bias_modules=tuple(
                m
                for flag, modules in (
                    (self.attention_bias, ("q_proj", "k_proj", "v_proj")),
                    (self.o_proj_bias, ("o_proj",)),
                    (self.mlp_bias, ("gate_proj", "up_proj", "down_proj")),
                )
                if flag
                for m in modules
            ),
            moe=None
            if self.moe is None
            else MoeShapes(
                num_experts=self.moe.num_experts,
                expert_intermediate_size=self.moe.expert_intermediate_size,
                sparse_layers=self.moe.sparse_layers,
                shared_expert_intermediate_size=self.moe.shared_expert_intermediate_size,
            ),
        )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object; found {type(data).__name__}")
    return data


def _token_ids(value: Any, path: Path) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{path}: eos_token_id must be an int or a list of ints; found {value!r}")
    return tuple(values)


def _parse_rope(raw: dict[str, Any], path: Path, max_positions: int) -> RopeConfig:
    """RoPE from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (published configs)."""
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"{path}: rope_parameters must be one flat object (per-layer RoPE unsupported)")
        params = dict(params)
        theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    else:
        params = dict(raw.get("rope_scaling") or {})
        theta = raw.get("rope_theta", 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    partial = params.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(
            f"{path}: partial_rotary_factor={partial} unsupported; expected 1.0 (partial rotary: Phi3 only)"
        )
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{path}: rope type {rope_type!r} unsupported (its frequencies depend on the sequence length "
            f"or are not implemented); expected one of {SUPPORTED_ROPE_TYPES}, see {MODEL_TABLE}"
        )
    original = params.pop("original_max_position_embeddings", None)
    if rope_type in ("llama3", "yarn") and original is None:
        # transformers falls back the same way (standardize_rope_params).
        original = raw.get("original_max_position_embeddings", max_positions)
    factor = params.pop("factor", None)
    if factor is None and rope_type != "default":
        raise ValueError(f"{path}: rope type {rope_type!r} needs a `factor`")
    extra = {k: params.pop(k) for k in _YARN_KEYS if k in params} if rope_type == "yarn" else {}
    return _checked(
        path,
        RopeConfig,
        rope_type=rope_type,
        theta=float(theta),
        factor=1.0 if factor is None else float(factor),
        low_freq_factor=float(params.pop("low_freq_factor", 1.0)),
        high_freq_factor=float(params.pop("high_freq_factor", 4.0)),
        original_max_position_embeddings=None if original is None else int(original),
        extra=extra,
    )


def _sliding_window(raw: dict[str, Any], model_type: str, path: Path, num_layers: int) -> int | None:
    """One window for every layer, or None; per-layer windows (Qwen2 max_window_layers) are refused."""
    # transformers' Mistral and Qwen2 configs default an absent window to 4096.
    window = raw.get("sliding_window", None if model_type == "phi3" else 4096)
    if model_type == "llama" or window is None:
        return None
    if model_type in ("mistral", "phi3"):  # every layer (transformers' Phi3 masks all layers alike)
        return int(window)
    if not raw.get("use_sliding_window", False):
        return None
    # Qwen2 slides only layers i >= max_window_layers (transformers' layer_types rule).
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if i >= raw.get("max_window_layers", 28) else "full_attention"
        for i in range(num_layers)
    ]
    if all(t == "full_attention" for t in layer_types):
        return None
    if all(t == "sliding_attention" for t in layer_types):
        return int(window)
    raise ValueError(f"{path}: sliding window on some layers only ({layer_types}) unsupported")


def _dtype(raw: dict[str, Any], path: Path) -> torch.dtype:
    name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if name not in _DTYPES:
        raise ValueError(f"{path}: dtype {name!r} unsupported; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _architecture(raw: dict[str, Any], path: Path) -> tuple[str, str]:
    archs = raw.get("architectures") or []
    arch = archs[0] if len(archs) == 1 else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: {architecture_refusal(archs, sorted(SUPPORTED_ARCHITECTURES))}")
    model_type = SUPPORTED_ARCHITECTURES[arch]
    if raw.get("model_type", model_type) != model_type:
        raise ValueError(f"{path}: model_type={raw['model_type']!r} does not match {arch} ({model_type!r})")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act={raw['hidden_act']!r} unsupported; expected 'silu'")
    return arch, model_type


def _required_int(raw: dict[str, Any], key: str, path: Path) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{path}: required field {key!r} must be an int; found {value!r}")
    return value


def _checked(path: Path, cls: type[_T], **fields: Any) -> _T:
    """Build a config dataclass; its own validation errors also name the file they came from."""
    try:
        return cls(**fields)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from exc


def load_model_config(model_dir: Path) -> ModelConfig:
    """Parse `model_dir/config.json` (and `generation_config.json` for EOS ids) into a ModelConfig."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}; expected a Hugging Face model directory")
    raw = _read_json(path)
    gemma = gemma_text(raw, path)
    if gemma is not None:
        raw = gemma.raw
    arch, model_type = _architecture(raw, path)
    int8_checkpoint = checkpoint_quantization(raw, path)
    hidden_size, num_heads, num_layers, vocab_size, intermediate_size = (
        _required_int(raw, key, path)
        for key in (
            "hidden_size",
            "num_attention_heads",
            "num_hidden_layers",
            "vocab_size",
            "intermediate_size",
        )
    )
    max_positions = int(raw.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[model_type])
    is_llama = model_type == "llama"
    # Llama's, Qwen3's and Gemma's `attention_bias` biases q/k/v and o; Qwen2 always biases q/k/v only.
    attention_bias = (model_type in ("llama", "qwen3", "qwen3_moe") or gemma is not None) and bool(
        raw.get("attention_bias", False)
    )
    qkv_bias = model_type == "qwen2" or (model_type == "qwen2_moe" and bool(raw.get("qkv_bias", True)))
    gen_path = Path(model_dir) / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else {}
    eos = _token_ids(gen.get("eos_token_id"), gen_path) or _token_ids(raw.get("eos_token_id"), path)
    bos = raw.get("bos_token_id", gen.get("bos_token_id"))
    head_dim = int(raw.get("head_dim") or _DEFAULT_HEAD_DIM.get(model_type, hidden_size // num_heads))
    if gemma is not None:
        rope = _parse_rope(gemma.global_rope, path, max_positions)
    elif model_type == "phi3":
        rope = _checked(path, RopeConfig, **phi3_rope_fields(raw, path, max_positions, head_dim))
    else:
        rope = _parse_rope(raw, path, max_positions)
    sliding_window = None if gemma is not None else _sliding_window(raw, model_type, path, num_layers)
    moe = moe_config(raw, model_type, num_layers, path)
    if moe is not None:
        sliding_window = moe_sliding_window(raw, model_type, path)
    return _checked(
        path,
        ModelConfig,
        architecture=arch,
        model_type=model_type,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_positions,
        rope=rope,
        attention_bias=qkv_bias or attention_bias,
        o_proj_bias=attention_bias,
        mlp_bias=is_llama and bool(raw.get("mlp_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        sliding_window=sliding_window,
        eos_token_ids=eos,
        bos_token_id=bos if isinstance(bos, int) else None,
        dtype=_dtype(raw, path),
        qk_norm=model_type in ("qwen3", "qwen3_moe") or (gemma is not None and model_type != "gemma2"),
        moe=moe,
        int8_checkpoint=int8_checkpoint,
        **({} if gemma is None else _gemma_fields(gemma, path, max_positions)),
    )


def _gemma_fields(gemma: GemmaText, path: Path, max_positions: int) -> dict[str, Any]:
    """ModelConfig fields of a Gemma 2 / 3 text model (gemma_config.py)."""
    local = None if gemma.local_rope is None else _parse_rope(gemma.local_rope, path, max_positions)
    return {
        "hidden_act": GEMMA_ACTIVATION,
        "gemma_layout": True,
        "layer_windows": gemma.layer_windows,
        "local_rope": local,
        "query_pre_attn_scalar": gemma.query_pre_attn_scalar,
        "attn_logit_softcapping": gemma.attn_logit_softcapping,
        "final_logit_softcapping": gemma.final_logit_softcapping,
        "has_vision_tower": gemma.has_vision_tower,
    }
