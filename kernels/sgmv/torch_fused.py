"""Segment loop on the CPU slot layout (layout.alloc_stacks): one shrink for all slices per adapter.

Per segment (the rows of one adapter): the slot's A factors of every slice are one contiguous
`[H_in, R_max * S]` block of the interleaved table, so the shrink is a single GEMM (GEMV for one row)
giving `v: [len, R_max, S]`; each slice then adds `v[:, :r, s] @ B_s[slot, :r]` into its columns of y
with the scale on `alpha`. Segments whose rows are one run (the engine groups each adapter's rows, so
always there) work on views of x and y in place; scattered rows are gathered and `index_add_`ed.
This is the engine's hot path on CPU, so the loop body is kept to the few tensor calls it needs: every
tensor call from Python costs microseconds, about as much as the small GEMMs themselves. The columns of
v beyond a slice's rank come from padding (possibly NaN) and are never used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from kernels.sgmv.checks import LoraLayout, SlotParams
from kernels.sgmv.layout import BagTables, stack_memo
from kernels.sgmv.meta import SgmvMeta


class SlotViews(NamedTuple):
    """Per-slot views of the stacks, made once per stack (views stay valid when slots are rewritten)."""

    blocks: list[Tensor]  # [N] x [H_in, R_max * S]: A of all slices of a slot
    b_full: list[list[Tensor]]  # [S][N] x [R_max, H_out_s]


def slot_views(
    lora_a: Sequence[Tensor], lora_b: Sequence[Tensor], tables: BagTables, layout: LoraLayout
) -> SlotViews:
    """The per-slot views, memoised with the stacks (layout.stack_memo: the engine passes the same ones)."""
    memo = stack_memo(lora_a, lora_b)
    if memo is not None and "slot_views" in memo:
        return memo["slot_views"]
    n, r_max = layout.num_slots, layout.max_rank
    blocks = list(tables.a.view(n, layout.hidden_in, r_max * layout.num_slices).unbind(0))
    b_full = [
        list(b.view(n, r_max, size).unbind(0)) for b, size in zip(tables.b, layout.out_sizes, strict=True)
    ]
    views = SlotViews(blocks, b_full)
    if memo is not None:
        memo["slot_views"] = views
    return views


def add_lora_segments(
    y: Tensor,
    x: Tensor,
    views: SlotViews,
    meta: SgmvMeta,
    params: SlotParams,
    layout: LoraLayout,
    only: Sequence[int] | None = None,
) -> None:
    """y += each segment's LoRA delta, for all segments or those listed in `only` (fp32, host params)."""
    ranks, scales = params.ranks_host, params.scales_host
    assert ranks is not None and scales is not None
    r_max, s_count = layout.max_rank, layout.num_slices
    blocks, b_full = views.blocks, views.b_full
    y_slices = [
        y.narrow(1, off, size) for off, size in zip(layout.out_offsets, layout.out_sizes, strict=True)
    ]
    slices = range(s_count)
    rows = meta.sorted_rows_host
    for g in range(meta.num_segments) if only is None else only:
        start, length, slot = meta.seg_starts_host[g], meta.seg_lens_host[g], meta.seg_slots_host[g]
        if length == 0:
            continue  # padding of fixed-capacity metadata (static_meta.py)
        row = rows[start]
        if rows[start + length - 1] - row != length - 1:
            _scattered(y_slices, x, views, meta, start, length, slot, ranks, scales)
            continue
        if length == 1:
            parts = torch.mv(blocks[slot].t(), x[row]).view(r_max, s_count).unbind(1)  # S x [R]
            for s in slices:
                r = ranks[s][slot]
                if r == r_max:
                    y_slices[s][row].addmv_(b_full[s][slot].t(), parts[s], alpha=scales[s][slot])
                elif r:
                    y_slices[s][row].addmv_(b_full[s][slot][:r].t(), parts[s][:r], alpha=scales[s][slot])
            continue
        end = row + length
        parts = torch.mm(x[row:end], blocks[slot]).view(length, r_max, s_count).unbind(2)  # S x [len, R]
        for s in slices:
            r = ranks[s][slot]
            if r == r_max:
                y_slices[s][row:end].addmm_(parts[s], b_full[s][slot], alpha=scales[s][slot])
            elif r:
                y_slices[s][row:end].addmm_(parts[s][:, :r], b_full[s][slot][:r], alpha=scales[s][slot])


def _scattered(
    y_slices: list[Tensor],
    x: Tensor,
    views: SlotViews,
    meta: SgmvMeta,
    start: int,
    length: int,
    slot: int,
    ranks: tuple[tuple[int, ...], ...],
    scales: tuple[tuple[float, ...], ...],
) -> None:
    """One adapter's rows that are not one run: gather, GEMMs, index_add_ (y is fp32 here)."""
    rows = meta.sorted_rows[start : start + length]
    v = torch.mm(x.index_select(0, rows), views.blocks[slot]).view(length, -1, len(y_slices))
    for s, y_slice in enumerate(y_slices):
        r = ranks[s][slot]
        if r:
            delta = torch.mm(v[:, :r, s], views.b_full[s][slot][:r])  # [len, H_s]
            y_slice.index_add_(0, rows, delta, alpha=scales[s][slot])
