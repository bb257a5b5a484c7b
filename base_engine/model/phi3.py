"""Phi-3 / Phi-3.5 / Phi-4 / Phi-4-mini (`Phi3ForCausalLM`) RoPE settings, read as transformers' `Phi3Config`
reads them (transformers 5.24, `configuration_phi3.py` + `modeling_rope_utils.py`).

- `rope_scaling` (published configs) or `rope_parameters` (transformers 5): type "longrope" or the default
  rotation. LongRoPE's old names "su" and "yarn" are refused: `Phi3Config` renames them to longrope only
  after its defaults are filled in, so transformers 5 cannot load such a config (there is no reference).
- `partial_rotary_factor` (Phi-4-mini: 0.75): only the first int(head_dim * factor) dims of each head
  rotate; the rest pass through.
- LongRoPE (Ding et al. 2024, "LongRoPE", arXiv:2402.13753): `short_factor` / `long_factor` divide the
  rotary frequencies (one entry per frequency, rotary_dim / 2 of them); `original_max_position_embeddings`
  is the top-level field (`Phi3Config` gives it priority over the one inside the RoPE object, and defaults
  it to 4096); cos and sin are multiplied by `attention_factor`, or, when it is absent, by
  sqrt(1 + ln(factor) / ln(original)) with factor = `factor` or max_position_embeddings / original (1 when
  factor <= 1). Which factor set a sequence uses is decided per sequence by the scheduler (see
  `RopeConfig.long_factor_after`).

Returns plain fields for `RopeConfig` (config.py builds it), so this module does not import config.py.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

_KNOWN_KEYS = frozenset(
    {"rope_type", "type", "rope_theta", "partial_rotary_factor", "short_factor", "long_factor", "factor"}
    | {"attention_factor", "original_max_position_embeddings"}
)
_DEFAULT_ORIGINAL = 4096  # Phi3Config.original_max_position_embeddings


def _factor_list(params: dict[str, Any], key: str, length: int, path: Path) -> tuple[float, ...]:
    value = params.get(key)
    if not isinstance(value, list) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in value
    ):
        raise ValueError(f"{path}: longrope `{key}` must be a list of positive numbers; found {value!r}")
    if len(value) != length:
        raise ValueError(
            f"{path}: longrope `{key}` has {len(value)} entries; expected rotary_dim / 2 = {length}"
        )
    return tuple(float(v) for v in value)


def _number(value: Any, key: str, path: Path) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{path}: rope `{key}` must be a positive number; found {value!r}")
    return float(value)


def phi3_rope_fields(raw: dict[str, Any], path: Path, max_positions: int, head_dim: int) -> dict[str, Any]:
    """`RopeConfig` keyword fields for a Phi3 config.json; anything else in its RoPE object is refused."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{path}: rope parameters must be one flat object; found {params!r}")
    unknown = sorted(set(params) - _KNOWN_KEYS)
    if unknown:
        raise ValueError(
            f"{path}: rope parameters {unknown} unsupported for Phi3; known: {sorted(_KNOWN_KEYS)}"
        )
    name = params.get("rope_type") or params.get("type") or "default"
    if name in ("su", "yarn"):
        raise ValueError(
            f"{path}: Phi3 rope type {name!r} (an old name of LongRoPE) unsupported: transformers 5 does not "
            "load it either; expected 'longrope' (as the current Phi-3 configs write it)"
        )
    if name not in ("default", "longrope"):
        raise ValueError(f"{path}: Phi3 rope type {name!r} unsupported; expected 'default' or 'longrope'")
    partial = _number(
        params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)),
        "partial_rotary_factor",
        path,
    )
    if int(head_dim * partial) % 2:
        raise ValueError(
            f"{path}: partial_rotary_factor={partial} rotates int({head_dim} * {partial}) dims; expected an "
            "even number (rotate-half pairs them)"
        )
    fields: dict[str, Any] = {
        "rope_type": "default",
        "theta": _number(params.get("rope_theta", raw.get("rope_theta", 10000.0)), "rope_theta", path),
        "partial_rotary_factor": partial,
    }
    if name == "default":
        return fields
    original = raw.get("original_max_position_embeddings", _DEFAULT_ORIGINAL)
    if not isinstance(original, int) or isinstance(original, bool) or original <= 1:
        raise ValueError(f"{path}: original_max_position_embeddings must be an int > 1; found {original!r}")
    num_freqs = int(head_dim * partial) // 2
    factor = params.get("factor")
    factor = max_positions / original if factor is None else _number(factor, "factor", path)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return fields | {
        "rope_type": "longrope",
        "factor": factor,
        "original_max_position_embeddings": original,
        "short_factor": _factor_list(params, "short_factor", num_freqs, path),
        "long_factor": _factor_list(params, "long_factor", num_freqs, path),
        "attention_factor": _number(attention_factor, "attention_factor", path),
    }
