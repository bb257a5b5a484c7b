"""Gemma 2 and Gemma 3 (text) config.json fields, read as transformers' Gemma2Config / Gemma3TextConfig /
Gemma3Config read them, with their defaults for fields a config.json leaves out.

`gemma_text` turns a Gemma config.json into the text model's fields (the nested `text_config` of a
`Gemma3ForConditionalGeneration`, whose vision tower the engine does not serve), the per-layer windows
(`layer_types`, or Gemma 2's alternation / Gemma 3's `sliding_window_pattern`) and the two RoPE
settings (Gemma 3: `rope_theta` + `rope_scaling` for global layers, `rope_local_base_freq` for local
ones, or transformers 5's per-layer-type `rope_parameters`). What the engine would not reproduce
exactly is refused by name. Plain values only: `config.py` builds the `ModelConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

GEMMA_ARCHITECTURES: dict[str, str] = {
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",
}
GEMMA_ACTIVATION = "gelu_pytorch_tanh"  # GeGLU with the tanh-approximated GELU
_LAYER_TYPES = ("sliding_attention", "full_attention")
_COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": GEMMA_ACTIVATION,
    "rms_norm_eps": 1e-6,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}
# transformers' class defaults, per text model type.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": _COMMON_DEFAULTS
    | {
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    "gemma3_text": _COMMON_DEFAULTS
    | {
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    },
}
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
# Top-level fields of a Gemma3ForConditionalGeneration config that the text model takes.
_TOP_LEVEL = (
    "eos_token_id",
    "bos_token_id",
    "dtype",
    "torch_dtype",
    "tie_word_embeddings",
    "quantization_config",
)


@dataclass(frozen=True)
class GemmaText:
    """A Gemma checkpoint's text model, as plain values for `config.load_model_config`."""

    raw: dict[str, Any]  # the text model's fields, transformers' defaults filled in (no hidden_act)
    has_vision_tower: bool  # Gemma3ForConditionalGeneration: its vision weights are not loaded
    layer_windows: tuple[int | None, ...]  # per layer: the sliding window, None = global attention
    global_rope: dict[str, Any]  # {"rope_parameters": {...}} of the global layers, for config._parse_rope
    local_rope: dict[str, Any] | None  # the same for the sliding layers when theirs differs (Gemma 3)
    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None


def gemma_text(raw: dict[str, Any], path: Path) -> GemmaText | None:
    """The text model of a Gemma config.json, or None when `raw` is not a Gemma architecture."""
    archs = raw.get("architectures") or []
    if len(archs) != 1 or archs[0] not in GEMMA_ARCHITECTURES:
        return None
    arch = archs[0]
    model_type = GEMMA_ARCHITECTURES[arch]
    if raw.get("model_type", model_type) != model_type:
        raise ValueError(f"{path}: model_type={raw['model_type']!r} does not match {arch} ({model_type!r})")
    has_vision = model_type == "gemma3"
    if has_vision:
        text = raw.get("text_config") or {}
        if not isinstance(text, dict) or text.get("model_type", "gemma3_text") != "gemma3_text":
            raise ValueError(f"{path}: text_config must be a gemma3_text config object; found {text!r:.80}")
        text = {**text, **{k: raw[k] for k in _TOP_LEVEL if k in raw}}
        text.setdefault("tie_word_embeddings", True)  # Gemma3Config's own default
        defaults = _DEFAULTS["gemma3_text"]
    else:
        text = raw
        defaults = _DEFAULTS[model_type]
    fields = {**defaults, **text}  # an explicit null stays null, as in transformers
    fields.update(architectures=[arch], model_type=model_type)
    _refuse_unsupported(fields, path, model_type)
    fields.pop("hidden_act", None)  # Gemma reads hidden_activation (Gemma 2 configs carry both)
    windows = _layer_windows(fields, path, model_type)
    global_rope, local_rope = _ropes(fields, path, model_type)
    return GemmaText(
        raw=fields,
        has_vision_tower=has_vision,
        layer_windows=windows,
        global_rope=global_rope,
        local_rope=local_rope,
        query_pre_attn_scalar=_positive(fields, "query_pre_attn_scalar", path),
        attn_logit_softcapping=_cap(fields, "attn_logit_softcapping", path),
        final_logit_softcapping=_cap(fields, "final_logit_softcapping", path),
    )


def _refuse_unsupported(fields: dict[str, Any], path: Path, model_type: str) -> None:
    if fields["hidden_activation"] != GEMMA_ACTIVATION:
        raise ValueError(
            f"{path}: hidden_activation={fields['hidden_activation']!r} unsupported; "
            f"expected {GEMMA_ACTIVATION!r}"
        )
    if fields.get("use_bidirectional_attention"):
        raise ValueError(f"{path}: use_bidirectional_attention=true unsupported; the engine attends causally")
    if model_type == "gemma2":
        return
    # transformers' Gemma 3 reads these fields but never applies them (Gemma3ForConditionalGeneration
    # not even the final cap): refused rather than guessing which of the two the checkpoint meant.
    ignored = ["attn_logit_softcapping"] + (["final_logit_softcapping"] if model_type == "gemma3" else [])
    for name in ignored:
        if fields.get(name) is not None:
            raise ValueError(
                f"{path}: {name}={fields[name]} unsupported on {model_type}: transformers' model does not "
                "apply it; expected null"
            )


def _positive(fields: dict[str, Any], name: str, path: Path) -> float:
    value = _cap(fields, name, path)
    if value is None:
        raise ValueError(f"{path}: {name}=null, expected a number > 0")
    return value


def _cap(fields: dict[str, Any], name: str, path: Path) -> float | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{path}: {name}={value!r}, expected null or a number > 0")
    return float(value)


def _layer_windows(fields: dict[str, Any], path: Path, model_type: str) -> tuple[int | None, ...]:
    num_layers = fields["num_hidden_layers"]
    if not isinstance(num_layers, int) or num_layers <= 0:
        raise ValueError(f"{path}: num_hidden_layers={num_layers!r}, expected an int > 0")
    layer_types = fields.get("layer_types")
    if layer_types is None:
        # transformers: Gemma 2 alternates sliding/global; Gemma 3 slides all but every pattern-th layer.
        pattern = 2 if model_type == "gemma2" else fields.get("sliding_window_pattern", 6)
        if not isinstance(pattern, int) or pattern < 1:
            raise ValueError(f"{path}: sliding_window_pattern={pattern!r}, expected an int >= 1")
        layer_types = [_LAYER_TYPES[0] if (i + 1) % pattern else _LAYER_TYPES[1] for i in range(num_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ValueError(
            f"{path}: layer_types must list one type per layer ({num_layers}); found {layer_types!r}"
        )
    unknown = sorted({t for t in layer_types if t not in _LAYER_TYPES}, key=str)
    if unknown:
        raise ValueError(f"{path}: layer_types {unknown} unsupported; expected entries of {_LAYER_TYPES}")
    window = fields.get("sliding_window")
    if _LAYER_TYPES[0] in layer_types and (
        isinstance(window, bool) or not isinstance(window, int) or window <= 0
    ):
        raise ValueError(
            f"{path}: sliding_window={window!r} with sliding_attention layers; expected an int > 0"
        )
    return tuple(window if t == _LAYER_TYPES[0] else None for t in layer_types)


def _ropes(
    fields: dict[str, Any], path: Path, model_type: str
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """({"rope_parameters": global}, {"rope_parameters": local} or None), flat objects for _parse_rope."""
    params = fields.get("rope_parameters")
    if model_type == "gemma2":
        if params is not None:
            return {"rope_parameters": params}, None
        return {
            "rope_theta": fields.get("rope_theta", 10000.0),
            "rope_scaling": fields.get("rope_scaling"),
        }, None
    if isinstance(params, dict) and set(params) <= set(_LAYER_TYPES) and params:
        # transformers 5: one object per layer type; a missing one or theta takes Gemma 3's default.
        ropes = {}
        for layer_type in _LAYER_TYPES:
            one = params.get(layer_type) or {"rope_type": "default"}
            if not isinstance(one, dict):
                raise ValueError(f"{path}: rope_parameters[{layer_type!r}] must be an object; found {one!r}")
            ropes[layer_type] = {"rope_theta": _GEMMA3_THETA[layer_type], **one}
    elif params is not None:
        raise ValueError(
            f"{path}: rope_parameters must hold 'full_attention' and 'sliding_attention' objects on Gemma 3; "
            f"found keys {sorted(params) if isinstance(params, dict) else params!r}"
        )
    else:
        # Published configs: global scaling in rope_scaling, the local layers' own base frequency.
        scaling = fields.get("rope_scaling") or {}
        if not isinstance(scaling, dict):
            raise ValueError(f"{path}: rope_scaling must be an object or null; found {scaling!r}")
        scaling = dict(scaling)
        if "type" in scaling:  # the legacy key
            scaling.setdefault("rope_type", scaling.pop("type"))
        ropes = {
            "full_attention": {
                "rope_type": "default",
                **scaling,
                "rope_theta": fields.get("rope_theta", _GEMMA3_THETA["full_attention"]),
            },
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": fields.get("rope_local_base_freq", _GEMMA3_THETA["sliding_attention"]),
            },
        }
    return {"rope_parameters": ropes["full_attention"]}, {"rope_parameters": ropes["sliding_attention"]}
