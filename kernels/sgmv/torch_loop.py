"""Segment-loop schedule of the PyTorch SGMV twin: Punica's "loop" baseline, done per segment.

For each segment (all rows of one adapter, from `build_meta`) and slice: shrink with the adapter's A
rows cut to its rank, then expand with B's columns cut to its rank, the scale riding on the expand's
`alpha`, into y. Weights are read in place, once per segment, so the loop moves the adapter bytes the
roofline counts and nothing more. Rows are addressed through the host copy of the sorted order: a
one-row segment (decode) or a run of rows (one request's prefill) is a view of x and y, and fp32 y
takes the expand in place (`addmv_` / `addmm_`), so such steps issue no gathers, no scatters and no
temporary the size of y; only scattered rows of one adapter go through a gather and an `index_add_`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from kernels.sgmv.checks import LoraLayout
from kernels.sgmv.meta import SgmvMeta

Ranks = tuple[tuple[int, ...], ...]  # [S][N] on the host
Scales = tuple[tuple[float, ...], ...]  # [S][N] on the host


class Segment(NamedTuple):
    slot: int
    start: int  # offset into meta.sorted_rows
    length: int
    row: int  # the first row
    is_contiguous: bool  # rows are row, row + 1, ..., row + length - 1 (one request's prefill, a decode row)


def segments(meta: SgmvMeta) -> Iterator[Segment]:
    rows = meta.sorted_rows_host
    for start, length, slot in zip(
        meta.seg_starts_host, meta.seg_lens_host, meta.seg_slots_host, strict=True
    ):
        if length == 0:
            continue  # padding of fixed-capacity metadata (static_meta.py)
        # rows of a segment ascend (stable sort), so they are contiguous iff they span exactly `length`
        yield Segment(slot, start, length, rows[start], rows[start + length - 1] - rows[start] == length - 1)


def rows_of(meta: SgmvMeta, seg: Segment) -> Tensor:
    """[len] int64 row indices of the segment (a view; made only where a gather needs it)."""
    return meta.sorted_rows[seg.start : seg.start + seg.length]


def segment_rows(t: Tensor, meta: SgmvMeta, seg: Segment) -> Tensor:
    """The segment's rows of t: a [H] view for one row, a [len, H] view for a run of rows, else a gather."""
    if seg.length == 1:
        return t[seg.row]
    if seg.is_contiguous:
        return t[seg.row : seg.row + seg.length]
    return t.index_select(0, rows_of(meta, seg))


def column_slices(y: Tensor, layout: LoraLayout) -> list[Tensor]:
    """Views y[:, off_s : off_s + H_out_s]."""
    return [y.narrow(1, off, size) for off, size in zip(layout.out_offsets, layout.out_sizes, strict=True)]


def weight(stack: Tensor, slot: int, rank: int, rank_dim: int) -> Tensor:
    """stack[slot] with its rank axis cut to `rank`, as fp32 (a view when already fp32)."""
    w = stack[slot]  # indexing is cheaper than .select() from Python
    if rank < stack.shape[rank_dim]:
        w = w.narrow(rank_dim - 1, 0, rank)
    return w if w.dtype == torch.float32 else w.float()


def add_rows(y: Tensor, rows: Tensor, delta: Tensor) -> None:
    """y[rows] += delta (fp32), touching no other row; low-precision y is rounded once."""
    if y.dtype == torch.float32:
        y.index_add_(0, rows, delta)
    else:
        summed = y.index_select(0, rows).float() + delta
        y.index_copy_(0, rows, summed.to(y.dtype))


def rescale_rows(y: Tensor, meta: SgmvMeta, out_scale: Tensor, out_shift: Tensor | None) -> None:
    """y[t] = out_scale[a_t] * y[t] (+ out_shift[a_t]) for the rows with an adapter, in fp32, after the
    delta (DoRA's per-slot output scale; plain-LoRA slots hold 1 and 0, so their rows keep their bits)."""
    m = meta.num_active_rows  # a fixed-capacity meta pads sorted_rows beyond its active rows
    rows, slots = meta.sorted_rows[:m], meta.sorted_slots[:m]
    scaled = y.index_select(0, rows).float().mul_(out_scale.index_select(0, slots))  # [M, sum(H_out)]
    if out_shift is not None:
        scaled.add_(out_shift.index_select(0, slots))
    y.index_copy_(0, rows, scaled.to(y.dtype))


def shrink_segment(
    x: Tensor, lora_a: Sequence[Tensor], meta: SgmvMeta, seg: Segment, ranks: Ranks
) -> list[Tensor]:
    """Per slice, x[rows] @ A[s][a, :r].T, unscaled: [r] for one row, else [len, r]."""
    x_seg = segment_rows(x, meta, seg)
    if x_seg.dtype != torch.float32:
        x_seg = x_seg.float()
    parts: list[Tensor | None] = []
    for s, a_stack in enumerate(lora_a):
        rank = ranks[s][seg.slot]
        if rank == 0:  # the adapter does not cover this slice (e.g. k_proj of a q/v adapter)
            parts.append(None)
            continue
        w = weight(a_stack, seg.slot, rank, 1)  # [r, H_in]
        # GEMV for one row: markedly faster than a one-row GEMM on CPU
        parts.append(torch.mv(w, x_seg) if seg.length == 1 else torch.mm(x_seg, w.t()))
    return parts


def expand_segment(
    y_slices: Sequence[Tensor],
    parts: Sequence[Tensor | None],
    lora_b: Sequence[Tensor],
    meta: SgmvMeta,
    seg: Segment,
    ranks: Ranks,
    scales: Scales | None,
) -> None:
    """y[rows, off_s : off_s + H_out_s] += scale(s, a) * parts[s] @ B[s][a, :, :r].T (y_slices[s]).

    The scale rides on the expand's `alpha` (no extra op); scales=None when parts are already scaled.
    """
    for s, (y_slice, b_stack, v) in enumerate(zip(y_slices, lora_b, parts, strict=True)):
        if v is None:
            continue  # rank 0: nothing to add
        w = weight(b_stack, seg.slot, ranks[s][seg.slot], 2)  # [H_out_s, r]
        alpha = 1.0 if scales is None else scales[s][seg.slot]
        if y_slice.dtype == torch.float32 and seg.is_contiguous:
            # in place on a view of y: no delta buffer, no scatter (decode rows, prefill runs)
            if seg.length == 1:
                y_slice[seg.row].addmv_(w, v, alpha=alpha)
            else:
                y_slice[seg.row : seg.row + seg.length].addmm_(v, w.t(), alpha=alpha)
        else:
            delta = torch.mv(w, v)[None] if v.dim() == 1 else torch.mm(v, w.t())  # [len, H_out_s]
            add_rows(y_slice, rows_of(meta, seg), delta.mul_(alpha))
