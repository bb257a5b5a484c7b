"""LoRA on an MoE layer's fused expert tensors, as PEFT's `lora.ParamWrapper` saves it.

For `target_parameters` entries on `mlp.experts.gate_up_proj` ([E, 2I, H]) and `mlp.experts.down_proj`
([E, H, I]), PEFT saves one pair per wrapped tensor under the experts module:
`...mlp.experts.lora_A.weight` [r * E, in] and `...lora_B.weight` [out, r * E]. With both tensors
wrapped, the wrappers nest and the inner pair sits under `...mlp.experts.base_layer.lora_A/B`; which
tensor is inner depends on the order PEFT met them, so each pair is told apart by its shapes: (in, out)
is (H, 2I) for gate_up_proj and (I, H) for down_proj, never equal. Expert e's factors are A rows
e*r:(e+1)*r and B columns j*E + e (`ParamWrapper.get_delta_weight`); they are stored here per expert:
`a` [E, r, in], `b` [E, out, r], so expert e's delta is `scale * b[e] @ a[e]`.
"""

from __future__ import annotations

import re

import torch

from adapters.factors import check_delta_bound, flush_subnormals
from adapters.types import AdapterFormatError, AdapterValidationError, BaseModelShapes

_PREFIX = "base_model.model."
_EXPERT_TENSOR = re.compile(
    r"base_model\.model\.model\.layers\.(?P<layer>\d+)\.mlp\.experts(?P<nest>(?:\.base_layer)*)"
    r"\.lora_(?P<which>[AB])(?:\.default)?\.weight"
)


def take_expert_tensors(
    tensors: dict[str, torch.Tensor], targets: dict[str, tuple[int, str]]
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """Remove the expert tensors from `tensors`: (layer, depth) -> {"A", "B"}, depth = nesting level."""
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    targeted_layers = {layer for layer, _ in targets.values()}
    for name in [n for n in tensors if _EXPERT_TENSOR.fullmatch(n)]:
        match = _EXPERT_TENSOR.fullmatch(name)
        assert match is not None
        layer = int(match.group("layer"))
        if layer not in targeted_layers:
            raise AdapterFormatError(
                f"tensor {name!r} is for the experts of layer {layer}, which target_parameters does not "
                "target (expected experts only on the MoE layers it names)"
            )
        pair = found.setdefault((layer, match.group("nest")), {})
        if match.group("which") in pair:
            raise AdapterFormatError(f"tensor {name!r} duplicates lora_{match.group('which')}")
        pair[match.group("which")] = tensors.pop(name)
    return found


def expert_pairs(
    found: dict[tuple[int, str], dict[str, torch.Tensor]],
    targets: dict[str, tuple[int, str]],
    ranks: dict[str, tuple[int, float]],
    base: BaseModelShapes,
    dtype: torch.dtype,
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]:
    """(layer, expert module) -> (a [E, r, in], b [E, out, r], scale) for every targeted expert tensor;
    `ranks` gives each parameter key's (r, scale)."""
    by_target: dict[tuple[int, str], tuple[str, dict[str, torch.Tensor]]] = {}
    for (layer, nest), pair in found.items():
        where = f"{_PREFIX}model.layers.{layer}.mlp.experts{nest}"
        if "A" not in pair or "B" not in pair:
            missing = [f"{where}.lora_{w}.weight" for w in "AB" if w not in pair]
            raise AdapterFormatError(f"expert LoRA tensors {missing} are missing")
        module = _module_by_shape(where, pair, base, layer, targets)
        if (layer, module) in by_target:
            raise AdapterFormatError(f"{where}: a second LoRA pair for {module} of layer {layer}")
        by_target[(layer, module)] = (where, pair)
    out = {}
    for key, (layer, module) in targets.items():
        if (layer, module) not in by_target:
            raise AdapterFormatError(
                f"target_parameters wraps {key!r} but its tensors "
                f"({_PREFIX}model.layers.{layer}.mlp.experts[.base_layer].lora_A/B.weight) are missing"
            )
        where, pair = by_target[(layer, module)]
        r, scale = ranks[key]
        out[(layer, module)] = _per_expert(where, key, pair, r, scale, base, module, dtype)
    return out


def _module_by_shape(
    where: str, pair: dict[str, torch.Tensor], base: BaseModelShapes, layer: int,
    targets: dict[str, tuple[int, str]],
) -> str:  # fmt: skip
    a, b = pair["A"], pair["B"]
    wanted = {m for lay, m in targets.values() if lay == layer}
    for module in sorted(wanted):
        _, in_features, out_features = base.expert_shape(module)
        if a.ndim == 2 and b.ndim == 2 and a.shape[1] == in_features and b.shape[0] == out_features:
            return module
    shapes = {m: base.expert_shape(m)[1:] for m in sorted(wanted)}
    raise AdapterFormatError(
        f"{where}.lora_A/B have shapes {tuple(a.shape)} / {tuple(b.shape)}, which fit none of the targeted "
        f"expert tensors of layer {layer} (in, out): {shapes} (expected A [r * num_experts, in], "
        "B [out, r * num_experts])"
    )


def _per_expert(
    where: str, key: str, pair: dict[str, torch.Tensor], r: int, scale: float, base: BaseModelShapes,
    module: str, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, float]:  # fmt: skip
    num_experts, in_features, out_features = base.expert_shape(module)
    expected = {"A": (r * num_experts, in_features), "B": (out_features, r * num_experts)}
    for which in "AB":
        if tuple(pair[which].shape) != expected[which]:
            raise AdapterFormatError(
                f"tensor {where}.lora_{which}.weight has shape {tuple(pair[which].shape)}, expected "
                f"{expected[which]} (r={r}, {num_experts} experts, {module} in={in_features}, "
                f"out={out_features})"
            )
    a = pair["A"].to(dtype).reshape(num_experts, r, in_features).contiguous()
    b = pair["B"].to(dtype).reshape(out_features, r, num_experts).permute(2, 0, 1).contiguous()
    for which, factor in (("A", a), ("B", b)):
        if not bool(torch.isfinite(factor).all()):
            raise AdapterValidationError(f"tensor {where}.lora_{which}.weight has non-finite values: {dtype}")
    a, b = flush_subnormals(a), flush_subnormals(b)
    # The bound over every expert at once: each expert's norms are at most these maxima.
    check_delta_bound(key, a.reshape(-1, in_features), b.reshape(-1, r), scale, dtype)
    return a, b, scale
