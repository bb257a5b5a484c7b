"""Device-resident adapter slots in exactly the layout `kernels.sgmv.add_lora` takes.

For every layer and packed projection (q/k/v -> qkv_proj, gate/up -> gate_up_proj, o_proj,
down_proj) the pool holds S stacked tensors `lora_a[s]: [N, R_max, H_in]`, `lora_b[s]:
[N, H_out_s, R_max]` plus `scales`/`ranks: [S, N]`, as strided views of storage laid out for the
device (`kernels.sgmv.layout.alloc_stacks`: on CPU the slices' A factors are interleaved so the twin
shrinks all slices of a projection in one call). Writing an adapter into slot n is the only
host-to-device work the engine step ever does for adapters. A module an adapter does not cover gets
rank 0 in that slot, so the kernels use nothing of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adapters.format import LoraAdapter
from adapters.types import FUSED_PROJECTIONS, BaseModelShapes
from kernels.sgmv.layout import alloc_stacks

# Packed projection -> the checkpoint modules it stacks, in output-column order.
PACKED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": FUSED_PROJECTIONS["qkv_proj"],
    "o_proj": ("o_proj",),
    "gate_up_proj": FUSED_PROJECTIONS["gate_up_proj"],
    "down_proj": ("down_proj",),
}


@dataclass(slots=True)
class ProjectionSlots:
    lora_a: list[torch.Tensor]  # S x [N, R_max, H_in] (strided views, see alloc_stacks)
    lora_b: list[torch.Tensor]  # S x [N, H_out_s, R_max] (transposed views of rank-major storage)
    scales: torch.Tensor  # [S, N] float32
    ranks: torch.Tensor  # [S, N] int32


class SlotPool:
    def __init__(
        self,
        base: BaseModelShapes,
        *,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = device
        self.layers: list[dict[str, ProjectionSlots]] = []
        for _ in range(base.num_layers):
            per_proj = {}
            for packed, modules in PACKED_PROJECTIONS.items():
                shapes = [base.module_shape(m) for m in modules]  # (in, out) each
                # the layout the kernels read best on this device (kernels/sgmv/layout.py)
                lora_a, lora_b = alloc_stacks(
                    num_slots, max_rank, shapes[0][0], [o for _, o in shapes], dtype=dtype, device=device
                )
                per_proj[packed] = ProjectionSlots(
                    lora_a=lora_a,
                    lora_b=lora_b,
                    scales=torch.zeros(len(modules), num_slots, dtype=torch.float32, device=device),
                    ranks=torch.zeros(len(modules), num_slots, dtype=torch.int32, device=device),
                )
            self.layers.append(per_proj)
        # Device memory the slot tensors hold (all slots, used or not); fixed for the pool's life.
        self.num_bytes = self.bytes_per_slot(base, max_rank, dtype) * num_slots

    @staticmethod
    def bytes_per_slot(base: BaseModelShapes, max_rank: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype, device="cpu").element_size()
        per_layer = sum(sum(base.module_shape(m)) for mods in PACKED_PROJECTIONS.values() for m in mods)
        return per_layer * max_rank * base.num_layers * element

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy an adapter's factors into slot `slot` (host -> device; non_blocking from pinned memory)."""
        for layer, per_proj in enumerate(self.layers):
            for packed, modules in PACKED_PROJECTIONS.items():
                proj = per_proj[packed]
                for s, module in enumerate(modules):
                    pair = adapter.weights.get((layer, module))
                    if pair is None:
                        proj.ranks[s, slot] = 0
                        proj.scales[s, slot] = 0.0
                        continue
                    rank = pair.a.shape[0]
                    proj.lora_a[s][slot, :rank].copy_(pair.a, non_blocking=True)
                    proj.lora_b[s][slot, :, :rank].copy_(pair.b, non_blocking=True)
                    proj.ranks[s, slot] = rank
                    proj.scales[s, slot] = pair.scale
