"""Decode buckets: the decodes of one step grouped by blocks read, each group one padded SDPA call.

Host-side, once per step (`ModelRunner`), for the bucketed PyTorch path of `base_engine.runner.attention`:
`plan_decode_buckets` cuts the decodes, sorted by length, where padding plus a fixed cost per bucket
is least; `build_decode_buckets` turns each cut into a `DecodeBucket` (padded block tables + mask);
`build_token_buckets` does the same for a deterministic step, where every token attends alone.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(slots=True)
class DecodeBucket:
    """Decodes of similar length, attended by one SDPA over keys padded to this bucket's own longest.

    Keys are addressed locally: key j of row i is token `first_block_i * block_size + j` of its sequence,
    where first_block_i skips blocks wholly outside a sliding window (0 without one). Keys always span
    whole blocks: SDPA on CPU gives a row bits that depend on the rest of its batch when the key length
    is odd (torch 2.13, 2 query heads per KV head), so an exact-length slice would make a row's output
    depend on which other lengths share its bucket.

    Masked keys get a softmax weight of exactly 0, but 0 * NaN is NaN: every slot a row may read beyond
    its length must hold finite values whoever used it before. That holds by construction: padding
    points at the null block (never allocated, always zero) and a block is zeroed when it is handed to
    a new owner (`ModelRunner.clear_blocks`), so the tail of a row's last block is zero or its own.
    """

    rows: torch.Tensor  # [n] int64 rows of the flattened batch, ascending
    first_row: int | None  # rows are exactly [first_row, first_row + n): slice instead of gather/scatter
    block_tables: torch.Tensor  # [n, num_blocks] int64, padded with the null block to the longest row
    mask: torch.Tensor | None  # [n, 1, 1, num_blocks * bs] additive (0 / -inf); None: every key valid
    shared_keys: bool = False  # block_tables is [1, num_blocks]: every row reads the same blocks


# Bucketing rule. A bucket costs a fixed ~80 us (5 small ops: 1 row of 1 block takes 83 us) plus
# ~6-12 us per block it reads (gather + SDPA; 64 rows x 12 blocks: 9.1 ms), so a bucket is worth
# about BUCKET_COST_BLOCKS blocks of padding. The decodes, sorted by blocks, are cut where
# sum(BUCKET_COST_BLOCKS + rows * widest) is least (exact, by dynamic programming over the distinct
# block counts: <= 25 of them at 4k context and block size 16, so ~300 steps of Python per step).
# Measured (benchmarks/decode_attention.py shapes: 64 decodes, contexts 32..384, bs 16, KVH 4, G 2,
# D 64, 2 shared CPU threads, 3 seeds; ms per layer): one padded group 12.7-13.0; 8 equal-size groups
# 7.1-8.4; this rule 6.2-8.5 (equal to 12% faster than equal groups), ~8 buckets. A greedy cut at 12.5%
# padding waste gave only 6 buckets and 8.5-10 ms; 12 or 16 groups gained nothing over 8. Unlike
# equal-size groups, it keeps one length in one bucket (maskless if it fills whole blocks) and a lone
# outlier by itself.
MAX_DECODE_BUCKETS = 8
BUCKET_COST_BLOCKS = 8


def plan_decode_buckets(
    num_blocks: list[int], *, max_buckets: int = MAX_DECODE_BUCKETS, bucket_cost: int = BUCKET_COST_BLOCKS
) -> list[list[int]]:
    """Partition decodes (given by the blocks each must read) into buckets of indices, longest first.

    e.g. num_blocks [3, 24, 3, 23, 3, 22, 24, 3] -> [[1, 6, 3, 5], [0, 2, 4, 7]]: 4 x 24 + 4 x 3
    blocks read plus 2 buckets (124) beats one bucket (8 x 24 + 8 = 200) and four (137).
    """
    if max_buckets < 1:
        raise ValueError(f"max_buckets={max_buckets}, expected >= 1")
    order = sorted(range(len(num_blocks)), key=lambda i: -num_blocks[i])
    widths: list[int] = []  # distinct block counts, descending
    starts: list[int] = []  # where each width's rows begin in `order`, then len(order)
    for pos, i in enumerate(order):
        if not widths or widths[-1] != num_blocks[i]:
            widths.append(num_blocks[i])
            starts.append(pos)
    starts.append(len(order))
    runs = _cheapest_runs(widths, starts, bucket_cost)
    while len(runs) > max_buckets:
        runs = _merge_cheapest(runs, widths, starts)
    return [order[starts[a] : starts[b]] for a, b in runs]


def _cheapest_runs(widths: list[int], starts: list[int], bucket_cost: int) -> list[tuple[int, int]]:
    """Runs [a, b) of width groups minimising sum(bucket_cost + widths[a] * rows in groups a..b-1)."""
    num = len(widths)
    best = [0.0] + [math.inf] * num  # best[b]: cheapest split of groups [0, b)
    cut = [0] * (num + 1)  # cut[b]: start of the last run in that split
    for b in range(1, num + 1):
        for a in range(b):
            cost = best[a] + bucket_cost + widths[a] * (starts[b] - starts[a])
            if cost < best[b]:
                best[b], cut[b] = cost, a
    runs = []
    b = num
    while b:
        runs.append((cut[b], b))
        b = cut[b]
    return runs[::-1]


def _merge_cheapest(
    runs: list[tuple[int, int]], widths: list[int], starts: list[int]
) -> list[tuple[int, int]]:
    """Over the bucket cap: merge the neighbours whose merge pads the fewest blocks (the shorter run's
    rows padded to the longer run's width)."""
    extra = [
        (widths[a] - widths[c]) * (starts[d] - starts[c])
        for (a, _), (c, d) in zip(runs, runs[1:], strict=False)
    ]
    k = extra.index(min(extra))
    return runs[:k] + [(runs[k][0], runs[k + 1][1])] + runs[k + 2 :]


class _DecodeSpan(NamedTuple):
    """What one decode reads: its blocks (minus those wholly outside a sliding window) and the range
    [lo, hi) of valid keys counted from the first of those blocks."""

    row: int
    blocks: list[int]
    lo: int
    hi: int


def build_decode_buckets(
    rows: list[int],
    block_tables: list[list[int]],
    seq_lens: list[int],
    *,
    block_size: int,
    sliding_window: int | None,
    dtype: torch.dtype,
    null_block: int,
    max_buckets: int = MAX_DECODE_BUCKETS,
) -> list[DecodeBucket]:
    """Host-side, once per step: decode i sits at row rows[i], has seq_lens[i] tokens (the new one
    included, already in the cache) and reads them through block_tables[i]. Shorter rows of a bucket
    are padded with `null_block`, a block no request owns and that stays zero."""
    spans = [
        _span(row, table, num_tokens, block_size, sliding_window)
        for row, table, num_tokens in zip(rows, block_tables, seq_lens, strict=True)
    ]
    buckets = []
    for members in plan_decode_buckets([len(s.blocks) for s in spans], max_buckets=max_buckets):
        # ascending rows: a contiguous run of rows is then a plain slice
        members_by_row = sorted((spans[i] for i in members), key=lambda s: s.row)
        buckets.append(_bucket(members_by_row, block_size, dtype, null_block))
    return buckets


def build_token_buckets(
    rows: list[int],
    block_tables: list[list[int]],
    seq_lens: list[int],
    seq_ids: list[int],
    *,
    block_size: int,
    sliding_window: int | None,
    dtype: torch.dtype,
) -> list[DecodeBucket]:
    """A deterministic step (base_engine/invariant.py): every token, prefill or decode, attends alone
    as a decode would, with seq_lens[i] = its position + 1. A bucket holds tokens of exactly one width
    (blocks read), always with a mask: a token's keys, their padding and its SDPA call's shape then
    depend only on its own position, never on its chunk, its batch or whether it is recomputed. Sharing
    a call with other rows leaves a row's bits alone (measured: SDPA on CPU, fixed query length, keys
    gathered or broadcast). Tokens of one sequence (seq_ids) that read the same blocks share one
    gathered copy of them (`shared_keys`); single tokens (decodes) are bucketed across sequences."""
    groups: dict[tuple[int, int, int], list[_DecodeSpan]] = {}
    tokens_of = Counter(seq_ids)
    for row, table, num_tokens, seq in zip(rows, block_tables, seq_lens, seq_ids, strict=True):
        span = _span(row, table, num_tokens, block_size, sliding_window)
        key = (len(span.blocks), seq, span.blocks[0]) if tokens_of[seq] > 1 else (len(span.blocks), -1, -1)
        groups.setdefault(key, []).append(span)
    return [
        _bucket(
            sorted(group, key=lambda s: s.row),
            block_size,
            dtype,
            null_block=-1,
            always_mask=True,
            shared_keys=key[1] >= 0,
        )  # fmt: skip
        for key, group in sorted(groups.items())
    ]


def _span(
    row: int, table: list[int], num_tokens: int, block_size: int, sliding_window: int | None
) -> _DecodeSpan:
    # e.g. bs 4, 10 tokens: blocks 0..2, keys [0, 10); window 5: tokens 5..9 -> blocks 1..2, keys [1, 6)
    lo = 0 if sliding_window is None else max(0, num_tokens - sliding_window)
    first, end = lo // block_size, -(-num_tokens // block_size)
    offset = first * block_size
    return _DecodeSpan(row, table[first:end], lo - offset, num_tokens - offset)


def _bucket(
    spans: list[_DecodeSpan],
    block_size: int,
    dtype: torch.dtype,
    null_block: int,
    *,
    always_mask: bool = False,
    shared_keys: bool = False,
) -> DecodeBucket:
    num, width = len(spans), max(len(s.blocks) for s in spans)
    tables = [s.blocks + [null_block] * (width - len(s.blocks)) for s in spans]
    if shared_keys:
        tables = tables[:1]
    num_keys = width * block_size
    mask = None
    if always_mask or any(
        s.lo != 0 or s.hi != num_keys for s in spans
    ):  # e.g. one length filling whole blocks: none
        key_pos = torch.arange(num_keys, device="cpu").unsqueeze(0)  # [1, L]
        lo = torch.tensor([s.lo for s in spans], device="cpu").unsqueeze(1)  # [n, 1]
        hi = torch.tensor([s.hi for s in spans], device="cpu").unsqueeze(1)
        valid = (key_pos >= lo) & (key_pos < hi)  # [n, L]
        mask = torch.zeros(valid.shape, dtype=dtype, device="cpu").masked_fill_(~valid, float("-inf"))
        mask = mask.view(num, 1, 1, num_keys)
    first_row, last_row = spans[0].row, spans[-1].row
    return DecodeBucket(
        rows=torch.tensor([s.row for s in spans], dtype=torch.long, device="cpu"),
        first_row=first_row if last_row - first_row + 1 == num else None,
        block_tables=torch.tensor(tables, dtype=torch.long, device="cpu"),
        mask=mask,
        shared_keys=shared_keys,
    )
