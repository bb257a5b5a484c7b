"""Device-resident adapter slots in exactly the layout `kernels.sgmv.add_lora` takes.

For every layer and packed projection (q/k/v -> qkv_proj, gate/up -> gate_up_proj, o_proj,
down_proj) the pool holds S stacked tensors `lora_a[s]: [N, R_max, H_in]`, `lora_b[s]:
[N, H_out_s, R_max]` plus `scales`/`ranks: [S, N]`, as strided views of storage laid out for the
device (`kernels.sgmv.layout.alloc_stacks`: on CPU the slices' A factors are interleaved so the twin
shrinks all slices of a projection in one call). Writing an adapter into slot n is the only
host-to-device work the engine step ever does for adapters. A module an adapter does not cover gets
rank 0 in that slot, so the kernels use nothing of it.

DoRA: each packed projection also holds `out_scale: [N, sum(H_out_s)]` float32 (1 where the slot's
adapter is plain LoRA or does not cover the module) and, when the base projection has a bias,
`out_shift` (0 there); `dora_slots` says on the host which slots need them, so a step without DoRA
rows never passes them to the kernels.

Embedding LoRA: `embedding[slot]` holds the slot's factors on the device as the gather reads them,
A^T [vocab, r] and B^T [r, hidden], written with the adapter and dropped when the slot is rewritten by
one without (not preallocated: most adapters have none, and a vocab-sized stack per slot would cost
every slot). Their bytes are the adapter's, counted by the cache (adapters/cache.py `adapter_bytes`).
lm_head LoRA likewise: `lm_head[slot]` holds A [r, hidden] and B [vocab, r] as F.linear takes them; and
modules_to_save: `replacements[slot]` holds the adapter's own [vocab, hidden] lm_head / embed_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adapters.expert_slots import alloc_expert_slots, expert_bytes_per_slot, write_expert_slots
from adapters.format import LoraAdapter, LoraPair
from adapters.types import FUSED_PROJECTIONS, MOE_GATES, BaseModelShapes
from kernels.sgmv.layout import alloc_stacks

# Packed projection -> the checkpoint modules it stacks, in output-column order.
PACKED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": FUSED_PROJECTIONS["qkv_proj"],
    "o_proj": ("o_proj",),
    "gate_up_proj": FUSED_PROJECTIONS["gate_up_proj"],
    "down_proj": ("down_proj",),
}


_MOE_GATE_SLOTS = {gate: (gate,) for gate in MOE_GATES}


def layer_projections(base: BaseModelShapes, layer: int) -> dict[str, tuple[str, ...]]:
    """The packed projections layer `layer` has: all four on a dense layer; on an MoE layer attention,
    the router, and Qwen2-MoE's shared expert (gate/up/down) and its gate."""
    if not base.is_sparse(layer):
        return PACKED_PROJECTIONS
    keep = (
        ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if base.has_mlp(layer) else ("qkv_proj", "o_proj")
    )
    gates = ("router", "shared_expert_gate") if base.moe_shared_size is not None else ("router",)
    return {k: v for k, v in PACKED_PROJECTIONS.items() if k in keep} | {g: (g,) for g in gates}


@dataclass(slots=True)
class ProjectionSlots:
    lora_a: list[torch.Tensor]  # S x [N, R_max, H_in] (strided views, see alloc_stacks)
    lora_b: list[torch.Tensor]  # S x [N, H_out_s, R_max] (transposed views of rank-major storage)
    scales: torch.Tensor  # [S, N] float32
    ranks: torch.Tensor  # [S, N] int32
    out_scale: torch.Tensor  # [N, sum(H_out_s)] float32, DoRA's m / ||W + s B A|| (1: not DoRA)
    out_shift: torch.Tensor | None  # [N, sum(H_out_s)] float32 (1 - out_scale) * bias; None: no bias
    dora_slots: set[int]  # host: slots whose adapter rescales this projection
    covered: set[int]  # host: slots whose adapter has LoRA on this projection


@dataclass(frozen=True, slots=True)
class EmbeddingSlot:
    a_t: torch.Tensor  # [vocab, r]: row t is lora_embedding_A[:, t]
    b_t: torch.Tensor  # [r, hidden]: lora_embedding_B transposed
    scale: float


@dataclass(frozen=True, slots=True)
class HeadSlot:
    a: torch.Tensor  # [r, hidden]: lora_A of lm_head
    b: torch.Tensor  # [vocab, r]: lora_B of lm_head
    scale: float


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
        for layer in range(base.num_layers):
            per_proj = {}
            for packed, modules in layer_projections(base, layer).items():
                shapes = [base.module_shape(m, layer) for m in modules]  # (in, out) each
                # the layout the kernels read best on this device (kernels/sgmv/layout.py)
                lora_a, lora_b = alloc_stacks(
                    num_slots, max_rank, shapes[0][0], [o for _, o in shapes], dtype=dtype, device=device
                )
                width = sum(o for _, o in shapes)
                biased = any(m in base.bias_modules for m in modules)
                per_proj[packed] = ProjectionSlots(
                    lora_a=lora_a,
                    lora_b=lora_b,
                    scales=torch.zeros(len(modules), num_slots, dtype=torch.float32, device=device),
                    ranks=torch.zeros(len(modules), num_slots, dtype=torch.int32, device=device),
                    out_scale=torch.ones(num_slots, width, dtype=torch.float32, device=device),
                    out_shift=torch.zeros(num_slots, width, dtype=torch.float32, device=device)
                    if biased
                    else None,
                    dora_slots=set(),
                    covered=set(),
                )
            self.layers.append(per_proj)
        # MoE: per sparse layer, the expert tensors' virtual slots (adapters/expert_slots.py)
        self.experts = alloc_expert_slots(base, num_slots, max_rank, dtype, device)
        self.embedding: dict[int, EmbeddingSlot] = {}  # slot -> its adapter's embedding LoRA, if any
        self.lm_head: dict[int, HeadSlot] = {}  # slot -> its adapter's lm_head LoRA, if any
        # slot -> {"lm_head" | "embed_tokens": [vocab, hidden]} of its adapter's modules_to_save, if any
        self.replacements: dict[int, dict[str, torch.Tensor]] = {}
        # Device memory the slot tensors hold (all slots, used or not); fixed for the pool's life.
        self.num_bytes = self.bytes_per_slot(base, max_rank, dtype) * num_slots

    @staticmethod
    def bytes_per_slot(base: BaseModelShapes, max_rank: int, dtype: torch.dtype) -> int:
        """Factors at max_rank plus the float32 DoRA vectors (out_scale; out_shift where biased)."""
        element = torch.empty((), dtype=dtype, device="cpu").element_size()
        total = expert_bytes_per_slot(base, max_rank, dtype)
        for layer in range(base.num_layers):
            projections = layer_projections(base, layer)
            factors = sum(sum(base.module_shape(m, layer)) for mods in projections.values() for m in mods)
            vectors = 0
            for modules in projections.values():
                width = sum(base.module_shape(m, layer)[1] for m in modules)
                vectors += width * (2 if any(m in base.bias_modules for m in modules) else 1)
            total += factors * max_rank * element + vectors * 4
        return total

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy an adapter's factors into slot `slot` (host -> device; non_blocking from pinned memory)."""
        self.embedding.pop(slot, None)
        if adapter.embedding is not None:
            e = adapter.embedding
            self.embedding[slot] = EmbeddingSlot(
                e.a.to(self.device, non_blocking=True).T.contiguous(),
                e.b.to(self.device, non_blocking=True).T.contiguous(),
                e.scale,
            )
        self.lm_head.pop(slot, None)
        self.replacements.pop(slot, None)
        if adapter.replacements:
            self.replacements[slot] = {
                name: t.to(self.device, non_blocking=True) for name, t in adapter.replacements.items()
            }
        if adapter.lm_head is not None:
            h = adapter.lm_head
            self.lm_head[slot] = HeadSlot(
                h.a.to(self.device, non_blocking=True), h.b.to(self.device, non_blocking=True), h.scale
            )
        write_expert_slots(self.experts, slot, adapter)
        for layer, per_proj in enumerate(self.layers):
            for packed, proj in per_proj.items():
                modules = PACKED_PROJECTIONS.get(packed) or _MOE_GATE_SLOTS[packed]
                self._write_out_vectors(proj, slot, [adapter.weights.get((layer, m)) for m in modules])
                if any((layer, m) in adapter.weights for m in modules):
                    proj.covered.add(slot)
                else:
                    proj.covered.discard(slot)
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

    @staticmethod
    def _write_out_vectors(proj: ProjectionSlots, slot: int, pairs: list[LoraPair | None]) -> None:
        """DoRA's vectors of the slot across the packed output (1 and 0 where a module is not DoRA)."""
        if not any(p is not None and p.out_scale is not None for p in pairs):
            if slot in proj.dora_slots:
                proj.out_scale[slot].fill_(1.0)
                if proj.out_shift is not None:
                    proj.out_shift[slot].zero_()
                proj.dora_slots.discard(slot)
            return
        offset = 0
        for s, pair in enumerate(pairs):
            width = proj.lora_b[s].shape[1]
            cols = slice(offset, offset + width)
            offset += width
            has = pair is not None and pair.out_scale is not None
            if has:
                proj.out_scale[slot, cols].copy_(pair.out_scale, non_blocking=True)
            else:
                proj.out_scale[slot, cols].fill_(1.0)
            if proj.out_shift is not None:
                if has and pair.out_shift is not None:
                    proj.out_shift[slot, cols].copy_(pair.out_shift, non_blocking=True)
                else:
                    proj.out_shift[slot, cols].zero_()
        proj.dora_slots.add(slot)
