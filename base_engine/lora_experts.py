"""LoRA on MoE experts inside one step: each (token, expert) pair gets its row's adapter's delta for
that expert, through the same SGMV op as the dense projections.

The fused MoE layer sorts its pairs by expert once (kernels/moe/routing.py). A pair of row t routed to
expert e gets virtual slot `slot(t) * E + e` in the pool's expert stacks (adapters/expert_slots.py), or
-1 when its row has no adapter or its adapter has no LoRA on this layer's experts: SGMV's segments are
then the (adapter, expert) pairs of the step, and a pair at -1 is never written. The base grouped GEMM
runs as without adapters and the deltas are added to its output in place, so a base row's values are
exactly those of a step without adapters, and a row's delta depends only on its own adapter and experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adapters.expert_slots import ExpertSlots
from kernels.moe.routing import Routing
from kernels.sgmv import SgmvMeta, add_lora, build_meta


@dataclass(frozen=True, slots=True)
class ExpertStep:
    """One layer's expert LoRA for this step: the pairs' virtual slots and their SGMV metadata."""

    slots: dict[str, ExpertSlots]
    pair_slots: torch.Tensor  # [T * k] int64 virtual slots, -1 for pairs without an expert delta
    meta: SgmvMeta

    def apply(self, module: str, y: torch.Tensor, x: torch.Tensor) -> None:
        """y[pair] += scale * B_e (A_e x[pair]) for each pair with an expert delta, in place."""
        slots = self.slots[module]
        args = (y, x, slots.lora_a, slots.lora_b, self.pair_slots)
        if y.device.type != "cpu":
            add_lora(*args, scales=slots.scales, ranks=slots.ranks, meta=self.meta)
            return
        threads = torch.get_num_threads()  # many small matmuls: extra threads only add barrier waits
        torch.set_num_threads(1)
        try:
            add_lora(*args, scales=slots.scales, ranks=slots.ranks, meta=self.meta)
        finally:
            torch.set_num_threads(threads)


def expert_step(
    layers: list[dict[str, ExpertSlots]],
    token_slots: torch.Tensor,
    step_slots: set[int],
    layer: int,
    routing: Routing,
    invariant: bool,
) -> ExpertStep | None:
    """The layer's expert LoRA for the step's pairs, or None when no row of the step has one there."""
    slots = layers[layer]
    with_experts = set().union(*(s.slots_with for s in slots.values())) & step_slots if slots else set()
    if not with_experts:
        return None
    any_slots = next(iter(slots.values()))
    num_experts = any_slots.num_experts
    num_slots = any_slots.ranks.shape[1] // num_experts
    has = torch.zeros(num_slots, dtype=torch.bool)
    has[sorted(with_experts)] = True
    has = has.to(token_slots.device)
    row = token_slots.to(torch.int64).index_select(0, routing.token_ids)  # [T * k]
    keep = (row >= 0) & has[row.clamp(min=0)]
    virtual = torch.where(keep, row * num_experts + routing.experts, torch.full_like(row, -1))
    meta = build_meta(virtual, num_slots * num_experts, invariant=invariant)
    return ExpertStep(slots, virtual, meta)
