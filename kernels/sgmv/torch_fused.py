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

import torch
from torch import Tensor

from kernels.sgmv.checks import LoraLayout, SlotParams
from kernels.sgmv.layout import BagTables
from kernels.sgmv.meta import SgmvMeta


def add_lora_segments(
    y: Tensor,
    x: Tensor,
    tables: BagTables,
    meta: SgmvMeta,
    params: SlotParams,
    layout: LoraLayout,
    only: Sequence[int] | None = None,
) -> None:
    """y += each segment's LoRA delta, for all segments or those listed in `only` (fp32, host params)."""
    ranks, scales = params.ranks_host, params.scales_host
    assert ranks is not None and scales is not None
    n, r_max, s_count = layout.num_slots, layout.max_rank, layout.num_slices
    blocks = tables.a.view(n, layout.hidden_in, r_max * s_count)  # [N, H_in, R*S]
    b_stacks = [b.view(n, r_max, size) for b, size in zip(tables.b, layout.out_sizes, strict=True)]
    y_slices = [
        y.narrow(1, off, size) for off, size in zip(layout.out_offsets, layout.out_sizes, strict=True)
    ]
    slices = range(s_count)
    rows = meta.sorted_rows_host
    for g in range(meta.num_segments) if only is None else only:
        start, length, slot = meta.seg_starts_host[g], meta.seg_lens_host[g], meta.seg_slots_host[g]
        row = rows[start]
        if rows[start + length - 1] - row != length - 1:
            _scattered(y_slices, x, blocks[slot], b_stacks, meta, start, length, slot, ranks, scales)
        elif length == 1:
            v = torch.mv(blocks[slot].t(), x[row]).view(r_max, s_count)  # [R, S]
            for s in slices:
                r = ranks[s][slot]
                if r:
                    w = b_stacks[s][slot] if r == r_max else b_stacks[s][slot, :r]  # [r, H_s]
                    y_slices[s][row].addmv_(w.t(), v[:r, s], alpha=scales[s][slot])
        else:
            end = row + length
            v = torch.mm(x[row:end], blocks[slot]).view(length, r_max, s_count)  # [len, R, S]
            for s in slices:
                r = ranks[s][slot]
                if r:
                    w = b_stacks[s][slot] if r == r_max else b_stacks[s][slot, :r]
                    y_slices[s][row:end].addmm_(v[:, :r, s], w, alpha=scales[s][slot])


def _scattered(
    y_slices: list[Tensor],
    x: Tensor,
    block: Tensor,
    b_stacks: list[Tensor],
    meta: SgmvMeta,
    start: int,
    length: int,
    slot: int,
    ranks: tuple[tuple[int, ...], ...],
    scales: tuple[tuple[float, ...], ...],
) -> None:
    """One adapter's rows that are not one run: gather, GEMMs, index_add_ (y is fp32 here)."""
    rows = meta.sorted_rows[start : start + length]
    v = torch.mm(x.index_select(0, rows), block).view(length, -1, len(b_stacks))
    for s, (y_slice, b_stack) in enumerate(zip(y_slices, b_stacks, strict=True)):
        r = ranks[s][slot]
        if r:
            delta = torch.mm(v[:, :r, s], b_stack[slot, :r])  # [len, H_s]
            y_slice.index_add_(0, rows, delta, alpha=scales[s][slot])
