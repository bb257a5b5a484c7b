"""Third schedule of the PyTorch twin: padded batched matmuls over the segments.

Rows are laid out as [slots, K, H_in] (K = longest segment) and each slice needs one `bmm` for
shrink and one for expand, whatever the number of adapters, reading every used adapter's weights
in place (no per-row copies). It wins when many adapters each own a few rows (decode with
distinct adapters), where the segment loop pays a few dozen small matmuls per slice. Padding costs
compute only, so it is chosen when the padded layout is at least half full. Running example:
segments of slots [2, 5] with 3 and 2 rows, K = 3 -> padded positions [0, 1, 2, 3, 4] of [2 x 3].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kernels.sgmv import torch_loop
from kernels.sgmv.checks import LoraLayout, SlotParams
from kernels.sgmv.meta import SgmvMeta

MIN_FILL = 0.5  # rows / (segments * K) at or above which padding beats the loop
MIN_SEGMENTS = 4  # below this the loop is only a handful of matmuls anyway


def uniform_rank(meta: SgmvMeta, params: SlotParams) -> int | None:
    """The rank every used (slice, slot) has, if they all agree; then nothing needs masking."""
    if params.ranks_host is None or params.scales_host is None:
        return None
    ranks = {
        params.ranks_host[s][slot] for s in range(len(params.ranks_host)) for slot in meta.seg_slots_host
    }
    return ranks.pop() if len(ranks) == 1 else None


def use_padded(meta: SgmvMeta, params: SlotParams) -> bool:
    if meta.num_segments < MIN_SEGMENTS or uniform_rank(meta, params) in (None, 0):
        return False
    return meta.num_active_rows >= MIN_FILL * meta.num_segments * meta.max_seg_len


def add_lora_padded(
    y: Tensor, x: Tensor, lora_a: Sequence[Tensor], lora_b: Sequence[Tensor], meta: SgmvMeta,
    params: SlotParams, layout: LoraLayout,
) -> None:  # fmt: skip
    rank = uniform_rank(meta, params)
    assert rank is not None and params.scales_host is not None
    num_seg, width = meta.num_segments, meta.max_seg_len
    # padded position of each sorted row: segment index * K + offset inside its segment
    pos = [g * width + i for g, length in enumerate(meta.seg_lens_host) for i in range(length)]
    pos_t = torch.tensor(pos, dtype=torch.long, device=x.device)
    slots = torch.tensor(meta.seg_slots_host, dtype=torch.long, device=x.device)
    xs = x.index_select(0, meta.sorted_rows).float()  # [M, H_in]
    xp = xs.new_zeros(num_seg * width, xs.shape[1]).index_copy_(0, pos_t, xs).view(num_seg, width, -1)
    deltas = []
    for s, (a_stack, b_stack) in enumerate(zip(lora_a, lora_b, strict=True)):
        # Used slots' factors, cut to the shared rank: [G, R, H_in] and [G, H_out, R]
        a = _used(a_stack, slots, meta, layout)[:, :rank].float()
        b = _used(b_stack, slots, meta, layout)[:, :, :rank].float()
        v = torch.bmm(xp, a.transpose(1, 2))  # [G, K, R]
        scale = torch.tensor([params.scales_host[s][slot] for slot in meta.seg_slots_host], device=x.device)
        v.mul_(scale.view(num_seg, 1, 1))
        out = torch.bmm(v, b.transpose(1, 2))  # [G, K, H_out]
        deltas.append(out.view(num_seg * width, -1).index_select(0, pos_t))
    torch_loop.add_rows(y, meta.sorted_rows, torch.cat(deltas, dim=1))


def _used(stack: Tensor, slots: Tensor, meta: SgmvMeta, layout: LoraLayout) -> Tensor:
    """stack[slots] without a copy when the used slots are exactly 0..N-1 in order."""
    if meta.seg_slots_host == tuple(range(layout.num_slots)):
        return stack
    return stack.index_select(0, slots)
