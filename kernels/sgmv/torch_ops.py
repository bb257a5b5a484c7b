"""Pure-PyTorch twin of the SGMV kernels (what the engine runs on CPU).

Two schedules over the rows sorted by `build_meta`, both from the Punica paper's comparison
(Chen et al., MLSys 2024; section 1.4 of our kernel notes):
  * segment loop: per (segment, slice) one shrink and one expand matmul (GEMV for one-row
    segments) on that segment's rows; each adapter's weights are read once, in place, so this is
    the bandwidth schedule whenever weights are large;
  * gather + bmm: per-row copies of the weights, then two batched matmuls per slice; a handful of
    ops whatever the batch, so it wins when many adapters with tiny weights own one or two rows.
Both compute in float32 and write only the rows that have an adapter, so -1 rows and anything
outside y stay bit-identical. Entries beyond a slot's rank are never used: sliced off when ranks are
on the host, otherwise replaced by zeros with `masked_fill` (a 0/1 multiply would let NaN through).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kernels.sgmv import cost_model, torch_bag, torch_fused, torch_loop
from kernels.sgmv.checks import LoraLayout, SlotParams
from kernels.sgmv.layout import BagTables, bag_tables
from kernels.sgmv.meta import SgmvMeta

# Gather + bmm copies every row's weights: only for many short segments of light adapters.
GATHER_MIN_SEGMENTS = 8
GATHER_MAX_ROWS_PER_SEGMENT = 2
GATHER_MAX_ROW_BYTES = 32 * 1024
CPU_LAYOUT_DTYPES = (torch.float32, torch.bfloat16)


def use_gather(meta: SgmvMeta, layout: LoraLayout, params: SlotParams) -> bool:
    if params.ranks_host is None or params.scales_host is None:
        return True  # the loop slices and scales with host numbers; gather needs none
    row_bytes = 4 * layout.max_rank * (layout.hidden_in + sum(layout.out_sizes))
    return (
        meta.num_segments >= GATHER_MIN_SEGMENTS
        and meta.num_active_rows <= GATHER_MAX_ROWS_PER_SEGMENT * meta.num_segments
        and row_bytes <= GATHER_MAX_ROW_BYTES
    )


def _bag_plan(meta: SgmvMeta, layout: LoraLayout, x: Tensor) -> torch_bag.BagPlan | None:
    """The rows this projection hands to bags, by the cost model (cached on the meta: the layers of a
    step share their projections' shapes)."""
    w_bytes = cost_model.weight_bytes(layout, x.element_size())
    key = ("bag_max_rows", w_bytes, x.dtype)
    if key not in meta.scratch:
        costs = cost_model.costs_for(x.dtype, x.device)
        meta.scratch[key] = cost_model.bag_max_rows(meta.seg_lens_host, w_bytes, costs)
    max_rows = meta.scratch[key]
    return torch_bag.plan(meta, max_rows) if max_rows else None


def _rank_keep(params: SlotParams, s: int, meta: SgmvMeta, max_rank: int) -> Tensor | None:
    """[M, R_max] bool, True where column < rank(s, slot of the row); None when nothing is masked."""
    if params.ranks_host is not None and all(
        params.ranks_host[s][a] >= max_rank for a in meta.seg_slots_host
    ):
        return None
    cols = torch.arange(max_rank, device=meta.device)
    return cols[None, :] < params.ranks[s].index_select(0, meta.sorted_slots)[:, None]


def shrink_gather(x: Tensor, lora_a: Sequence[Tensor], meta: SgmvMeta, params: SlotParams) -> Tensor:
    """fp32 [S, M, R_max] scaled intermediates of the sorted rows; zero beyond each row's rank."""
    xs = x.index_select(0, meta.sorted_rows).float()  # [M, H_in]
    max_rank = lora_a[0].shape[1]
    vs = xs.new_empty(len(lora_a), xs.shape[0], max_rank)
    for s, a_stack in enumerate(lora_a):
        w = a_stack.index_select(0, meta.sorted_slots).float()  # [M, R, H_in], one copy per row
        keep = _rank_keep(params, s, meta, max_rank)
        if keep is not None:
            w.masked_fill_(~keep[:, :, None], 0.0)
        torch.bmm(w, xs[:, :, None], out=vs[s][:, :, None])
    # scale per (slice, row): [S, M] broadcast over R
    return vs.mul_(params.scales.index_select(1, meta.sorted_slots)[:, :, None])


def expand_gather(vs: Tensor, lora_b: Sequence[Tensor], meta: SgmvMeta, params: SlotParams) -> Tensor:
    """fp32 [M, sum(H_out_s)] deltas of the sorted rows from [S, M, R_max] intermediates."""
    max_rank = vs.shape[2]
    outs = []
    for s, b_stack in enumerate(lora_b):
        w = b_stack.index_select(0, meta.sorted_slots).float()  # [M, H_out_s, R]
        v = vs[s]  # [M, R]
        keep = _rank_keep(params, s, meta, max_rank)
        if keep is not None:
            w.masked_fill_(~keep[:, None, :], 0.0)
            v = v.masked_fill(~keep, 0.0)  # a caller's intermediate may hold garbage beyond the rank
        outs.append(torch.bmm(w, v[:, :, None])[:, :, 0])
    return torch.cat(outs, dim=1)


def add_lora_torch(
    y: Tensor,
    x: Tensor,
    lora_a: Sequence[Tensor],
    lora_b: Sequence[Tensor],
    meta: SgmvMeta,
    params: SlotParams,
    layout: LoraLayout,
) -> None:
    if meta.num_active_rows == 0:
        return
    if meta.invariant:
        _add_lora_invariant(y, x, lora_a, lora_b, meta, params, layout)
        return
    # The CPU layout (layout.py) with host ranks and scales, in fp32 or bf16 (FBGEMM's bf16 bags and
    # oneDNN's bf16 GEMMs accumulate in fp32): bag schedule and fused segment loop.
    host = params.ranks_host is not None and params.scales_host is not None
    tables = bag_tables(lora_a, lora_b) if host and x.dtype in CPU_LAYOUT_DTYPES else None
    if tables is not None:
        bag_plan = _bag_plan(meta, layout, x)
        views = torch_fused.slot_views(lora_a, lora_b, tables, layout)
        if bag_plan is None:
            torch_fused.add_lora_segments(y, x, views, meta, params, layout)
            return
        torch_bag.add_lora_bag(y, x, tables, meta, bag_plan, params, layout)
        if bag_plan.long_segments:
            torch_fused.add_lora_segments(y, x, views, meta, params, layout, bag_plan.long_segments)
        return
    if use_gather(meta, layout, params):
        delta = expand_gather(shrink_gather(x, lora_a, meta, params), lora_b, meta, params)
        torch_loop.add_rows(y, meta.sorted_rows, delta)
        return
    ranks, scales = params.ranks_host, params.scales_host
    assert ranks is not None and scales is not None  # use_gather() said so
    y_slices = torch_loop.column_slices(y, layout)
    for seg in torch_loop.segments(meta):
        parts = torch_loop.shrink_segment(x, lora_a, meta, seg, ranks)
        torch_loop.expand_segment(y_slices, parts, lora_b, meta, seg, ranks, scales)


def _add_lora_invariant(
    y: Tensor,
    x: Tensor,
    lora_a: Sequence[Tensor],
    lora_b: Sequence[Tensor],
    meta: SgmvMeta,
    params: SlotParams,
    layout: LoraLayout,
) -> None:
    """The per-row bag schedule for every row (a row's bits depend on no other row). bf16 runs it on
    fp32 copies of x, y and the tables and rounds y once: other rows' bits come back unchanged, and
    the delta is summed in fp32 as in the float32 schedules."""
    host = params.ranks_host is not None and params.scales_host is not None
    tables = bag_tables(lora_a, lora_b) if host else None
    if tables is None or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(
            "batch-invariant LoRA needs float32 or bfloat16 CPU-layout weight stacks with host ranks and "
            f"scales (got {x.dtype}, host ranks and scales: {host})"
        )
    if x.dtype == torch.float32:
        torch_bag.add_lora_bag(y, x, tables, meta, torch_bag.plan_all(meta), params, layout)
        return
    wide = BagTables(tables.a.float(), [b.float() for b in tables.b])
    y32 = y.float()
    torch_bag.add_lora_bag(y32, x.float(), wide, meta, torch_bag.plan_all(meta), params, layout)
    y.copy_(y32)


def sgmv_shrink_torch(
    x: Tensor, lora_a: Sequence[Tensor], meta: SgmvMeta, params: SlotParams, layout: LoraLayout
) -> Tensor:
    """Row-ordered fp32 [S, T, R_max] intermediate (zero for rows without an adapter and beyond ranks)."""
    out = x.new_zeros(layout.num_slices, meta.num_tokens, layout.max_rank, dtype=torch.float32)
    if meta.num_active_rows == 0:
        return out
    if use_gather(meta, layout, params):
        out.index_copy_(1, meta.sorted_rows, shrink_gather(x, lora_a, meta, params))
        return out
    ranks, scales = params.ranks_host, params.scales_host
    assert ranks is not None and scales is not None
    for seg in torch_loop.segments(meta):
        rows = torch_loop.rows_of(meta, seg)
        for s, v in enumerate(torch_loop.shrink_segment(x, lora_a, meta, seg, ranks)):
            if v is not None:
                rank = v.shape[-1]
                out[s, :, :rank].index_copy_(0, rows, v.view(seg.length, rank) * scales[s][seg.slot])
    return out


def sgmv_expand_torch(
    y: Tensor, v: Tensor, lora_b: Sequence[Tensor], meta: SgmvMeta, params: SlotParams, layout: LoraLayout
) -> None:
    if meta.num_active_rows == 0:
        return
    if use_gather(meta, layout, params):
        delta = expand_gather(v.index_select(1, meta.sorted_rows), lora_b, meta, params)
        torch_loop.add_rows(y, meta.sorted_rows, delta)
        return
    ranks = params.ranks_host
    assert ranks is not None
    y_slices = torch_loop.column_slices(y, layout)
    for seg in torch_loop.segments(meta):
        parts: list[Tensor | None] = [
            torch_loop.segment_rows(v[s], meta, seg)[..., : ranks[s][seg.slot]]
            if ranks[s][seg.slot]
            else None
            for s in range(len(lora_b))
        ]
        torch_loop.expand_segment(y_slices, parts, lora_b, meta, seg, ranks, None)
