"""LoRA on MoE experts as saved on transformers 4, where each expert was its own SwiGLU MLP of
nn.Linear modules: `model.layers.L.mlp.experts.N.{gate_proj,up_proj,down_proj}` (Mixtral:
`block_sparse_moe.experts.N.{w1,w3,w2}`), one `lora_A` [r, in] / `lora_B` [out, r] pair per expert
module, and the router `mlp.gate` (`block_sparse_moe.gate`) an nn.Linear too.

transformers 5 fuses each layer's experts into `experts.gate_up_proj` [E, 2I, H] (gate rows first, then
up; Mixtral's w1 then w3) and `experts.down_proj` [E, H, I]. The per-expert pairs are served on those
tensors the way PEFT converts them when it loads such an adapter on transformers 5
(peft/utils/transformers_weight_conversion.py): for expert e, gate_up's A is gate's A over up's A
(rank r_gate + r_up) and its B the block diagonal of the two B's, so the fused delta is exactly the two
deltas stacked. Unlike PEFT's conversion, each module keeps its own rank and alpha pattern (a pattern
over expert modules is matched against the transformers-4 key, as the adapter was trained), a gate
without its up (or an expert left out) contributes zero, and the dense layers' MLP and Qwen2-MoE's
shared expert keep their LoRA (PEFT drops those tensors when it converts). Where the scales of one
fused tensor differ, they are folded into B and the pair's scale is 1.
"""

from __future__ import annotations

import torch

from adapters.expert_layouts import PER_EXPERT_MODULE, block_name
from adapters.factors import check_delta_bound, flush_subnormals
from adapters.types import AdapterFormatError, AdapterValidationError, BaseModelShapes

_FUSED_PARTS = (("experts.gate_up_proj", ("gate_proj", "up_proj")), ("experts.down_proj", ("down_proj",)))
# (key, factors {"A", "B"}, rank, scale) of one expert module
ExpertFactors = tuple[str, dict[str, torch.Tensor], int, float]


def fuse_per_expert(
    found: dict[tuple[int, str], ExpertFactors], base: BaseModelShapes, dtype: torch.dtype
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]:
    """(layer, "experts.N.part") -> factors, into (layer, EXPERT_MODULES entry) -> (a [E, R, in],
    b [E, out, R], scale) as adapters/experts.py returns them for the fused layout."""
    by_layer: dict[int, dict[tuple[int, str], ExpertFactors]] = {}
    for (layer, module), item in found.items():
        match = PER_EXPERT_MODULE.fullmatch(module)
        assert match is not None
        by_layer.setdefault(layer, {})[(int(match.group("expert")), match.group("part"))] = item
    out = {}
    for layer, items in sorted(by_layer.items()):
        for tensor, parts in _FUSED_PARTS:
            chosen = {k: v for k, v in items.items() if k[1] in parts}
            if chosen:
                out[(layer, tensor)] = _fuse(layer, tensor, parts, chosen, base, dtype)
    return out


def _checked(item: ExpertFactors, in_features: int, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    key, factors, r, _ = item
    for which in "AB":
        if which not in factors:
            raise AdapterFormatError(f"tensor base_model.model.{key}.lora_{which}.weight is missing")
    expected = {"A": (r, in_features), "B": (out_features, r)}
    for which in "AB":
        if tuple(factors[which].shape) != expected[which]:
            raise AdapterFormatError(
                f"tensor base_model.model.{key}.lora_{which}.weight has shape {tuple(factors[which].shape)}, "
                f"expected {expected[which]} (r={r}, in={in_features}, out={out_features})"
            )
        if not bool(torch.isfinite(factors[which]).all()):
            raise AdapterValidationError(
                f"tensor base_model.model.{key}.lora_{which}.weight has non-finite values"
            )
    return factors["A"].to(torch.float64), factors["B"].to(torch.float64)


def _fuse(
    layer: int, tensor: str, parts: tuple[str, ...], items: dict[tuple[int, str], ExpertFactors],
    base: BaseModelShapes, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, float]:  # fmt: skip
    num_experts, in_features, out_features = base.expert_shape(tensor)
    part_out = out_features // len(parts)
    ranks = {e: sum(items[(e, p)][2] for p in parts if (e, p) in items) for e in range(num_experts)}
    rank = max(ranks.values())
    scales = {item[3] for item in items.values()}
    fold = len(scales) > 1
    a = torch.zeros(num_experts, rank, in_features, dtype=torch.float64)
    b = torch.zeros(num_experts, out_features, rank, dtype=torch.float64)
    for e in range(num_experts):
        at = 0
        for j, part in enumerate(parts):
            if (e, part) not in items:
                continue
            item = items[(e, part)]
            pa, pb = _checked(item, in_features, part_out)
            r = item[2]
            a[e, at : at + r] = pa
            b[e, j * part_out : (j + 1) * part_out, at : at + r] = pb * item[3] if fold else pb
            at += r
    scale = 1.0 if fold else scales.pop()
    where = f"model.layers.{layer}.{block_name(base)}.experts.*"
    a, b = flush_subnormals(a.to(dtype)), flush_subnormals(b.to(dtype))
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        raise AdapterValidationError(f"{where}: factors (scales folded) are not finite in {dtype}")
    check_delta_bound(where, a.reshape(-1, in_features), b.reshape(-1, rank), scale, dtype)
    return a.contiguous(), b.contiguous(), scale
