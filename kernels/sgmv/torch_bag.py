"""Bag schedule of the PyTorch SGMV twin: the whole batch in one shrink and one expand per slice.

Punica's SGMV gathers each row's adapter inside the kernel; on CPU, `embedding_bag` is that kernel:
it sums weighted rows of a table picked by index, in one C++ loop over the batch, and reads each
picked row in place (no gathered copy of the weights). With the weights in the CPU layout of
`layout.alloc_stacks`:
  shrink  v[t, k*S + s] = sum_h x[t, h] * A[a_t, h, k, s]    bag t = rows (a_t, h) of table A,
                                                             weighted by x[t, h]  (all S slices at once)
  expand  y[t, slice s] += sum_{k < r(s, a_t)} v'[t, k, s] * B_s[a_t, k, :]
                                                             bag t = rows (a_t, k) of table B_s,
                                                             weighted by the scaled intermediate
So a step of 32 one-row adapters costs 1 + S operator calls per projection instead of 2 S per adapter,
and moves the adapters' bytes once. The shrink reads each picked A row whole (all R_max ranks): the
values beyond a slot's rank land in columns of v the expand never picks, so garbage or NaN there
never reaches y. Only rows of short segments (decodes, a few rows of one adapter) take this path;
long segments (prefill runs) stay with the segment loop's GEMMs, which reuse the weights across rows.
How short is decided per projection by cost_model.py from costs measured for the dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from kernels.sgmv.checks import LoraLayout, SlotParams
from kernels.sgmv.layout import BagTables
from kernels.sgmv.meta import SgmvMeta

SUM = 0  # embedding_bag mode
# Wide expands (a slice of >= EXPAND_CHUNKED_MIN columns) run as bags over 512-column pieces of B's
# rows: FBGEMM then accumulates a 2 KB tile per bag instead of a whole 16-56 KB output row. Llama-8B
# widths, 32 one-row adapters, 2 threads: 4096 columns 8.6 -> 9.5 GB/s, 14336 columns 10.6 -> 11.3.
EXPAND_CHUNK = 512
EXPAND_CHUNKED_MIN = 4096


class BagPlan(NamedTuple):
    """The rows a step hands to the bag schedule (built once per step, cached on the meta)."""

    rows: Tensor  # [M] int64 rows of x and y, ascending
    slots: Tensor  # [M] int64 their adapter slots
    slots_host: tuple[int, ...]
    distinct_slots: tuple[int, ...]
    all_rows: bool  # rows == 0..T-1: x and y are used whole (no gather, no scatter)
    long_segments: tuple[int, ...]  # indices of the segments left to the loop
    bags: dict  # bag indices and offsets per table width / ranks, built on first use, reused by all layers


def plan(meta: SgmvMeta, max_rows: int) -> BagPlan | None:
    """Rows of the segments of <= max_rows rows (cost_model.bag_max_rows); None when there are none."""
    key = ("bag_plan", max_rows)
    if key in meta.scratch:
        return meta.scratch[key]
    short, long = [], []
    for g, length in enumerate(meta.seg_lens_host):
        if length > 0:  # 0: padding of fixed-capacity metadata (static_meta.py)
            (short if length <= max_rows else long).append(g)
    result = _make_plan(meta, short, long) if short else None
    meta.scratch[key] = result
    return result


def plan_all(meta: SgmvMeta) -> BagPlan:
    """Every row in bags, whatever its segment's length: the one schedule of a batch-invariant step
    (each bag sums its own row in a fixed order; no GEMM whose blocking follows the batch)."""
    key = ("bag_plan", "all")
    if key not in meta.scratch:
        meta.scratch[key] = _make_plan(meta, [g for g, n in enumerate(meta.seg_lens_host) if n > 0], [])
    return meta.scratch[key]


def _make_plan(meta: SgmvMeta, short: list[int], long: list[int]) -> BagPlan:
    pairs = sorted(
        (meta.sorted_rows_host[i], meta.seg_slots_host[g])
        for g in short
        for i in range(meta.seg_starts_host[g], meta.seg_starts_host[g] + meta.seg_lens_host[g])
    )
    rows_host = tuple(p[0] for p in pairs)
    slots_host = tuple(p[1] for p in pairs)
    return BagPlan(
        rows=torch.tensor(rows_host, dtype=torch.int64, device=meta.device),
        slots=torch.tensor(slots_host, dtype=torch.int64, device=meta.device),
        slots_host=slots_host,
        distinct_slots=tuple(meta.seg_slots_host[g] for g in short),
        all_rows=len(rows_host) == meta.num_tokens,
        long_segments=tuple(long),
        bags={},
    )


def _bags(meta: SgmvMeta, bag_plan: BagPlan, width: int) -> tuple[Tensor, Tensor]:
    """Full bags of `width` rows per batch row: indices slot * width + j, offsets t * width."""
    key = ("bags", width)
    if key not in bag_plan.bags:
        steps = torch.arange(width, dtype=torch.int64, device=meta.device)
        indices = (bag_plan.slots[:, None] * width + steps[None, :]).reshape(-1)
        offsets = torch.arange(0, len(bag_plan.slots_host) * width, width, device=meta.device)
        bag_plan.bags[key] = (indices, offsets)
    return bag_plan.bags[key]


def _rank_bags(
    meta: SgmvMeta, bag_plan: BagPlan, max_rank: int, ranks: tuple[int, ...]
) -> tuple[Tensor, Tensor, Tensor]:
    """Bags of the first r(row) ranks: (indices, offsets, keep [M, R_max] bool) for one slice's ranks."""
    key = ("rank_bags", max_rank, ranks)
    if key not in bag_plan.bags:
        full, _ = _bags(meta, bag_plan, max_rank)
        row_ranks = torch.tensor(ranks, dtype=torch.int64, device=meta.device)
        keep = torch.arange(max_rank, device=meta.device)[None, :] < row_ranks[:, None]
        offsets = torch.cumsum(row_ranks, 0) - row_ranks
        bag_plan.bags[key] = (full.view(-1, max_rank)[keep], offsets, keep)
    return bag_plan.bags[key]


def _embedding_bag(table: Tensor, indices: Tensor, offsets: Tensor, weights: Tensor) -> Tensor:
    # (weight, indices, offsets, scale_grad_by_freq, mode, sparse, per_sample_weights, include_last_offset,
    # padding_idx): padding_idx must be None, -1 would mean the last row
    return torch.embedding_bag(table, indices, offsets, False, SUM, False, weights, False, None)[0]


def shrink(x: Tensor, tables: BagTables, meta: SgmvMeta, bag_plan: BagPlan, layout: LoraLayout) -> Tensor:
    """Unscaled fp32 [M, R_max, S] intermediates of the plan's rows (all ranks, all slices)."""
    indices, offsets = _bags(meta, bag_plan, layout.hidden_in)
    if bag_plan.all_rows:
        weights = x.reshape(-1)  # a view when x is contiguous
    else:
        weights = x.index_select(0, bag_plan.rows).reshape(-1)
    v = _embedding_bag(tables.a, indices, offsets, weights)
    return v.view(-1, layout.max_rank, layout.num_slices)


def expand(
    y: Tensor,
    v: Tensor,
    tables: BagTables,
    meta: SgmvMeta,
    bag_plan: BagPlan,
    params: SlotParams,
    layout: LoraLayout,
) -> None:
    """y[rows, slice s] += scale(s, a) * v[:, :r(s, a), s] @ B_s[a, :r(s, a)] for each slice."""
    assert params.ranks_host is not None
    # [M, R, S] * [M, 1, S] in fp32, rounded once to the tables' dtype (the bag's per-sample weights)
    v = (v.float() * params.scales.index_select(1, bag_plan.slots).t()[:, None, :]).to(tables.a.dtype)
    max_rank = layout.max_rank
    for s, (off, size) in enumerate(zip(layout.out_offsets, layout.out_sizes, strict=True)):
        slot_ranks = params.ranks_host[s]
        distinct = {slot_ranks[a] for a in bag_plan.distinct_slots}
        if distinct == {0} and not meta.invariant:
            continue  # no adapter of the batch covers this slice
        v_s = v[:, :, s]
        y_slice = y.narrow(1, off, size)
        # A batch-invariant step always takes the rank bags: the choice below follows the batch.
        full = distinct == {max_rank} and not meta.invariant
        if full and size % EXPAND_CHUNK == 0 and size >= EXPAND_CHUNKED_MIN:
            _expand_chunked(y_slice, v_s, tables.b[s], meta, bag_plan, max_rank, size)
            continue
        if full:
            indices, offsets = _bags(meta, bag_plan, max_rank)
            weights = v_s.reshape(-1)
        else:
            ranks = tuple(slot_ranks[a] for a in bag_plan.slots_host)
            indices, offsets, keep = _rank_bags(meta, bag_plan, max_rank, ranks)
            weights = v_s[keep]  # drops the columns beyond each row's rank (garbage or NaN)
        _add_rows(y_slice, _embedding_bag(tables.b[s], indices, offsets, weights), bag_plan)


def _add_rows(y_slice: Tensor, delta: Tensor, bag_plan: BagPlan) -> None:
    if bag_plan.all_rows:
        y_slice.add_(delta)
    else:
        y_slice.index_add_(0, bag_plan.rows, delta)


def _expand_chunked(
    y_slice: Tensor, v_s: Tensor, table_b: Tensor, meta: SgmvMeta, bag_plan: BagPlan, max_rank: int, size: int
) -> None:
    """Full-rank expand of a wide slice in EXPAND_CHUNK-column pieces: bag (row t, piece j) sums the
    pieces j of its adapter's R rows of B, so each bag accumulates one short tile (see EXPAND_CHUNK)."""
    pieces = size // EXPAND_CHUNK
    key = ("chunk_bags", max_rank, pieces)
    if key not in bag_plan.bags:
        rows = _bags(meta, bag_plan, max_rank)[0].view(-1, max_rank)  # [M, R] rows of the [N*R, H] table
        piece = torch.arange(pieces, device=v_s.device)
        indices = (rows[:, None, :] * pieces + piece[None, :, None]).reshape(-1)  # [M, J, R]
        offsets = torch.arange(0, indices.numel(), max_rank, device=v_s.device)
        bag_plan.bags[key] = (indices, offsets)
    indices, offsets = bag_plan.bags[key]
    weights = v_s[:, None, :].expand(-1, pieces, -1).reshape(-1)  # v[t, k] for every piece j
    delta = _embedding_bag(table_b.view(-1, EXPAND_CHUNK), indices, offsets, weights)  # [M * J, chunk]
    _add_rows(y_slice, delta.view(-1, size), bag_plan)


def add_lora_bag(
    y: Tensor,
    x: Tensor,
    tables: BagTables,
    meta: SgmvMeta,
    bag_plan: BagPlan,
    params: SlotParams,
    layout: LoraLayout,
) -> None:
    expand(y, shrink(x, tables, meta, bag_plan, layout), tables, meta, bag_plan, params, layout)
