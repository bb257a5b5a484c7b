"""Device slots for LoRA on MoE experts, in the layout `kernels.sgmv.add_lora` takes.

Each sparse layer holds, per expert tensor (EXPERT_MODULES), one stack of N * E virtual slots: adapter
slot n's expert e is virtual slot n * E + e, so a step's (token, expert) pairs with their rows' adapter
slots become one SGMV call whose segments are (adapter, expert) pairs. Allocated for every slot at
max_rank like the dense projections (`SlotPool`), so the device tier's bytes per slot count them: a
rank-r adapter on E experts costs E times one MLP's factors. A slot whose adapter has no expert LoRA on
a layer has rank 0 on all its E virtual slots there, and `slots_with` (host) tells the step which
slots have any, so a step without expert rows never builds the per-layer metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from adapters.format import LoraAdapter
from adapters.types import EXPERT_MODULES, BaseModelShapes
from kernels.sgmv.layout import alloc_stacks


@dataclass(slots=True)
class ExpertSlots:
    lora_a: list[torch.Tensor]  # 1 x [N * E, R_max, H_in]
    lora_b: list[torch.Tensor]  # 1 x [N * E, H_out, R_max]
    scales: torch.Tensor  # [1, N * E] float32
    ranks: torch.Tensor  # [1, N * E] int32
    num_experts: int
    slots_with: set[int] = field(default_factory=set)  # host: adapter slots with LoRA on this tensor


def alloc_expert_slots(
    base: BaseModelShapes, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device
) -> list[dict[str, ExpertSlots]]:
    """Per layer: expert module -> its slots ({} on a dense layer)."""
    layers: list[dict[str, ExpertSlots]] = []
    for layer in range(base.num_layers):
        per_module = {}
        if base.is_sparse(layer):
            for module in EXPERT_MODULES:
                num_experts, hidden_in, hidden_out = base.expert_shape(module)
                virtual = num_slots * num_experts
                lora_a, lora_b = alloc_stacks(
                    virtual, max_rank, hidden_in, [hidden_out], dtype=dtype, device=device
                )
                per_module[module] = ExpertSlots(
                    lora_a=lora_a,
                    lora_b=lora_b,
                    scales=torch.zeros(1, virtual, dtype=torch.float32, device=device),
                    ranks=torch.zeros(1, virtual, dtype=torch.int32, device=device),
                    num_experts=num_experts,
                )
        layers.append(per_module)
    return layers


def expert_bytes_per_slot(base: BaseModelShapes, max_rank: int, dtype: torch.dtype) -> int:
    """Factor bytes one adapter slot holds for experts at max_rank (0 on a dense model)."""
    if base.moe is None:
        return 0
    element = torch.empty((), dtype=dtype).element_size()
    per_layer = 0
    for module in EXPERT_MODULES:
        num_experts, hidden_in, hidden_out = base.expert_shape(module)
        per_layer += num_experts * max_rank * (hidden_in + hidden_out)
    return per_layer * element * sum(base.moe.sparse_layers)


def write_expert_slots(layers: list[dict[str, ExpertSlots]], slot: int, adapter: LoraAdapter) -> None:
    """Copy an adapter's expert factors into slot `slot` (rank 0 where it has none)."""
    for layer, per_module in enumerate(layers):
        for module, slots in per_module.items():
            rows = slice(slot * slots.num_experts, (slot + 1) * slots.num_experts)
            pair = adapter.experts.get((layer, module))
            if pair is None:
                slots.ranks[0, rows] = 0
                slots.scales[0, rows] = 0.0
                slots.slots_with.discard(slot)
                continue
            rank = pair.a.shape[1]
            slots.lora_a[0][rows, :rank].copy_(pair.a, non_blocking=True)
            slots.lora_b[0][rows, :, :rank].copy_(pair.b, non_blocking=True)
            slots.ranks[0, rows] = rank
            slots.scales[0, rows] = pair.scale
            slots.slots_with.add(slot)
