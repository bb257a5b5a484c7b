"""Which parameters a PEFT `target_parameters` list wraps (`lora.ParamWrapper`), on the served families.

PEFT 0.21 (`BaseTuner._inject_parameters`) walks every module and wraps each of its own parameters whose
key `<module key>.<param name>` equals a `target_parameters` entry or ends with `.<entry>`. Unlike
`target_modules`, it ignores `exclude_modules`, `layers_to_transform` and `layers_pattern`; the rank and
alpha patterns are looked up with that parameter key. The wrapper computes `F.linear(x, W + s B A)` for a
2-D weight (the same sum as LoRA on its module: `W x + s B A x`) and, for a 3-D expert tensor
[E, out, in], one delta per expert: `lora_A` [r * E, in] holds expert e's A in rows e*r:(e+1)*r and
`lora_B` [out, r * E] its B in columns j*E + e (`ParamWrapper.get_delta_weight`).

Served: the projections' weights (as LoRA on the projection), an MoE layer's router `mlp.gate.weight`
and Qwen2-MoE's `mlp.shared_expert_gate.weight` (a delta on their logits, per row), and its fused expert
tensors `mlp.experts.gate_up_proj` / `mlp.experts.down_proj` (adapters/experts.py). Refused by name:
embeddings, the LM head, norms and biases.
"""

from __future__ import annotations

import re
from typing import Any

from adapters.peft_targets import projection_key
from adapters.types import EXPERT_MODULES, AdapterFormatError, BaseModelShapes

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
# Parameters PEFT could wrap on our families that the engine does not serve with target_parameters.
_REFUSED: dict[str, str] = {
    r"embed_tokens\.weight": "the input embedding (target it with target_modules instead)",
    r"lm_head\.weight": "the LM head (target it with target_modules instead)",
    r".*norm\.weight": "a norm's weight (1-D; PEFT wraps 2-D and 3-D parameters only)",
    r".*\.bias": "a bias (1-D; PEFT wraps 2-D and 3-D parameters only)",
}


def parameter_keys(base: BaseModelShapes) -> dict[str, tuple[int, str] | None]:
    """Every 2-D/3-D parameter key of transformers' model for `base` -> (layer, projection or expert
    module) when served, None when refused (see `_REFUSED`)."""
    keys: dict[str, tuple[int, str] | None] = {"model.embed_tokens.weight": None, "lm_head.weight": None}
    for layer in range(base.num_layers):
        prefix = f"model.layers.{layer}"
        for module in base.projections:
            if module in _ATTENTION or not base.is_sparse(layer):
                keys[f"{projection_key(layer, module)}.weight"] = (layer, module)
        if not base.is_sparse(layer):
            continue
        keys[f"{prefix}.mlp.gate.weight"] = (layer, "router")
        for module in EXPERT_MODULES:
            keys[f"{prefix}.mlp.{module}"] = (layer, module)
        if base.moe_shared_size is not None:
            for module in ("gate_proj", "up_proj", "down_proj"):
                keys[f"{prefix}.mlp.shared_expert.{module}.weight"] = (layer, module)
            keys[f"{prefix}.mlp.shared_expert_gate.weight"] = (layer, "shared_expert_gate")
    return keys


def resolve_parameters(cfg: dict[str, Any], base: BaseModelShapes) -> dict[str, tuple[int, str]]:
    """Parameter key -> (layer, module) for every parameter `target_parameters` wraps; {} when unset."""
    entries = cfg.get("target_parameters")
    if entries is None or entries == []:
        return {}
    if not isinstance(entries, list) or not all(isinstance(e, str) and e for e in entries):
        raise AdapterFormatError(f"target_parameters={entries!r}, expected a list of parameter names")
    keys = parameter_keys(base)
    resolved: dict[str, tuple[int, str]] = {}
    for entry in entries:
        matched = [key for key in keys if key == entry or key.endswith(f".{entry}")]
        if not matched:
            raise AdapterFormatError(
                f"target_parameters entry {entry!r} names no 2-D or 3-D parameter of a {base.model_type} "
                f"model; expected e.g. 'mlp.experts.gate_up_proj', 'mlp.experts.down_proj' or "
                "'self_attn.q_proj.weight'"
            )
        for key in matched:
            target = keys[key]
            if target is None:
                raise AdapterFormatError(
                    f"target_parameters entry {entry!r} wraps {key!r}, {_refusal(key)}: not served; "
                    "expected the projections' weights or the MoE expert tensors"
                )
            resolved[key] = target
    return resolved


def _refusal(key: str) -> str:
    for pattern, why in _REFUSED.items():
        if re.fullmatch(rf"(?:.*\.)?{pattern}", key):
            return why
    return "a parameter outside the served projections"
