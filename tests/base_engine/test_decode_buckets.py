"""Decode attention in length buckets: outputs against a float64 per-sequence loop over the block
pool, and the bucketing rule (coverage, padding, optimal cost against brute force)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from base_engine.runner.attention import AttentionMetadata, PrefillChunk, attend, chunk_mask
from base_engine.runner.decode_buckets import MAX_DECODE_BUCKETS, build_decode_buckets, plan_decode_buckets

BS, H, KVH, D = 4, 8, 2, 16  # GQA: 4 query heads per KV head


def reference(
    q: torch.Tensor, kv_cache: torch.Tensor, table: list[int], pos: int, window: int | None
) -> torch.Tensor:
    """Float64 softmax for one query row at position `pos` over its own keys from the pool. [H, D]"""
    first = 0 if window is None else max(0, pos + 1 - window)
    slots = [table[p // BS] * BS + p % BS for p in range(first, pos + 1)]
    keys = kv_cache[0].flatten(0, 1)[slots].double()  # [L, KVH, D]
    values = kv_cache[1].flatten(0, 1)[slots].double()
    out = torch.empty(H, D, dtype=torch.float64)
    for h in range(H):
        kvh = h // (H // KVH)
        scores = keys[:, kvh] @ q[h].double() * D**-0.5  # [L]
        out[h] = torch.softmax(scores, 0) @ values[:, kvh]
    return out


def random_tables(rng: random.Random, lens: list[int], num_pool_blocks: int) -> list[list[int]]:
    """Distinct blocks per sequence, scattered through the pool (block 0 is left as padding)."""
    pool = list(range(1, num_pool_blocks))
    rng.shuffle(pool)
    tables, at = [], 0
    for n in lens:
        num = -(-n // BS)
        tables.append(pool[at : at + num])
        at += num
    return tables


def decode_lens(rng: random.Random) -> list[int]:
    # 1 .. 30 blocks, some last blocks partly filled; six of 30 full blocks, far enough from the rest
    # (<= 20 blocks) to form a bucket of their own that needs no mask.
    return [rng.randint(1, 20 * BS) for _ in range(20)] + [30 * BS] * 6 + [1, 2]


@pytest.mark.parametrize("window", [None, 7, 29])
@pytest.mark.parametrize("layout", ["contiguous", "interleaved", "offset_run"])
def test_bucketed_decode_equals_float64_reference(window: int | None, layout: str) -> None:
    rng = random.Random(f"{window}-{layout}")
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    lens = decode_lens(rng) if layout != "offset_run" else [9 * BS + 1] * 6
    # prefill chunks: (context_len, num_tokens); one fresh prompt and one continued
    chunk_shapes = [] if layout == "contiguous" else [(0, 5), (11, 3)]
    all_lens = lens + [c + n for c, n in chunk_shapes]
    tables = random_tables(rng, all_lens, num_pool_blocks=sum(-(-n // BS) for n in all_lens) + 1)
    kv_cache = torch.randn(2, len(tables) + sum(len(t) for t in tables), BS, KVH, D, generator=gen)

    # Rows: decodes first ("contiguous"); decodes and chunk rows mixed ("interleaved"); all decodes in
    # one run that starts after the chunks ("offset_run").
    items = [("d", i) for i in range(len(lens))] + [("p", j) for j in range(len(chunk_shapes))]
    if layout == "interleaved":
        rng.shuffle(items)
    elif layout == "offset_run":
        items = items[len(lens) :] + items[: len(lens)]
    rows, decode_ids, chunks, row_pos, row_table = [], [], [], [], []
    for kind, i in items:
        if kind == "d":
            rows.append(len(row_pos))
            decode_ids.append(i)
            row_pos.append(lens[i] - 1)
            row_table.append(tables[i])
            continue
        ctx, n = chunk_shapes[i]
        table = tables[len(lens) + i]
        chunks.append(PrefillChunk(len(row_pos), n, ctx, torch.tensor(table), chunk_mask(ctx, n, window)))
        row_pos += range(ctx, ctx + n)
        row_table += [table] * n
    buckets = build_decode_buckets(
        rows,
        [tables[i] for i in decode_ids],
        [lens[i] for i in decode_ids],
        block_size=BS,
        sliding_window=window,
        dtype=torch.float32,
        null_block=0,
    )
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long), decode_buckets=buckets, prefills=chunks
    )
    num_rows = len(row_pos)
    q = torch.randn(num_rows, H, D, generator=gen)
    # This step's K/V as the model would hand them over: exactly what sits in the pool at their slots.
    slots = torch.tensor([t[p // BS] * BS + p % BS for t, p in zip(row_table, row_pos, strict=True)])
    k, v = kv_cache[0].flatten(0, 1)[slots], kv_cache[1].flatten(0, 1)[slots]

    out = attend(q, k, v, kv_cache, meta, D**-0.5)

    for row in range(num_rows):
        expected = reference(q[row], kv_cache, row_table[row], row_pos[row], window)
        torch.testing.assert_close(out[row].double(), expected, atol=1e-5, rtol=1e-5, msg=f"row {row}")
    if layout == "offset_run":
        assert [b.first_row for b in buckets] == [5 + 3]  # the run of decodes starts after 8 chunk rows
    elif window is None:
        assert len(buckets) > 1
        assert any(b.mask is None for b in buckets) and any(b.mask is not None for b in buckets)


def test_one_length_of_whole_blocks_is_one_bucket_without_mask() -> None:
    tables = [list(range(10 * i + 1, 10 * i + 7)) for i in range(12)]
    rows = list(range(3, 15))
    [bucket] = build_decode_buckets(
        rows, tables, [6 * BS] * 12, block_size=BS, sliding_window=None, dtype=torch.float32, null_block=0
    )
    assert bucket.mask is None
    assert bucket.first_row == 3 and bucket.rows.tolist() == rows
    assert bucket.block_tables.tolist() == tables


def test_one_length_with_a_partial_block_masks_only_its_tail() -> None:
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    [bucket] = build_decode_buckets(
        [0, 2, 4],
        tables,
        [2 * BS + 1] * 3,
        block_size=BS,
        sliding_window=None,
        dtype=torch.float32,
        null_block=0,
    )
    assert bucket.first_row is None
    valid = bucket.mask.view(3, 3 * BS) == 0
    assert valid.all(0).tolist() == [True] * (2 * BS + 1) + [False] * (BS - 1)
    assert (valid == valid[:1]).all()


@pytest.mark.parametrize("seed", range(6))
def test_a_decode_gives_the_same_bits_at_any_row(seed: int) -> None:
    """The same decodes at other rows of the batch (as when other requests change adapters and so the
    row order) give bit-identical outputs. CPU SDPA breaks this for odd key lengths with 2 query heads
    per KV head (a row's bits then depend on which thread computes it), which whole-block keys avoid."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lens = [rng.randint(5, 10 * BS) for _ in range(8)]
    tables = random_tables(rng, lens, num_pool_blocks=8 * 10 + 1)
    kv_cache = torch.randn(2, 8 * 10 + 1, BS, 2, D, generator=gen)
    q = torch.randn(8, 4, D, generator=gen)  # 4 query heads, 2 KV heads

    def run(rows: list[int], num_rows: int) -> torch.Tensor:  # decode i at row rows[i] -> [8, H, D]
        buckets = build_decode_buckets(
            rows, tables, lens, block_size=BS, sliding_window=None, dtype=torch.float32, null_block=0
        )
        meta = AttentionMetadata(
            slot_mapping=torch.empty(0, dtype=torch.long), decode_buckets=buckets, prefills=[]
        )
        q_rows = torch.zeros(num_rows, 4, D).index_copy_(0, torch.tensor(rows), q)
        return attend(q_rows, q_rows, q_rows, kv_cache, meta, D**-0.5)[rows]

    moved = rng.sample(range(20), 8)
    assert torch.equal(run(list(range(8)), 8), run(moved, 20))


def test_spread_lengths_make_buckets_each_padded_to_its_own_longest() -> None:
    rng = random.Random(3)
    lens = [rng.randint(1, 30 * BS) for _ in range(64)]
    tables = random_tables(rng, lens, num_pool_blocks=64 * 30 + 1)
    rows = rng.sample(range(100), 64)
    buckets = build_decode_buckets(
        rows, tables, lens, block_size=BS, sliding_window=None, dtype=torch.float32, null_block=0
    )
    assert 1 < len(buckets) <= MAX_DECODE_BUCKETS
    seen = [r for b in buckets for r in b.rows.tolist()]
    assert sorted(seen) == sorted(rows)  # every decode in exactly one bucket
    by_row = {r: i for i, r in enumerate(rows)}
    for b in buckets:
        members = [by_row[r] for r in b.rows.tolist()]
        width = max(len(tables[i]) for i in members)
        assert b.block_tables.shape == (len(members), width)
        for line, i in zip(b.block_tables.tolist(), members, strict=True):
            assert line == tables[i] + [0] * (width - len(tables[i]))
    assert sum(b.block_tables.numel() for b in buckets) < 0.75 * 64 * max(len(t) for t in tables)


def test_sliding_window_reads_only_blocks_it_can_see() -> None:
    # 40 tokens, window 8: tokens 32..39 live in blocks 8 and 9 of the table; 10 tokens: blocks 0..2.
    tables = [list(range(100, 110)), [7, 8, 9]]
    buckets = build_decode_buckets(
        [0, 1], tables, [40, 10], block_size=BS, sliding_window=8, dtype=torch.float32, null_block=0
    )
    [bucket] = buckets
    assert bucket.block_tables.tolist() == [[108, 109, 0], [7, 8, 9]]
    # local keys: [0, 8) for the first (tokens 32..39), [2, 10) for the second (tokens 2..9)
    valid = bucket.mask.view(2, 3 * BS) == 0
    assert valid[0].nonzero().flatten().tolist() == list(range(0, 8))
    assert valid[1].nonzero().flatten().tolist() == list(range(2, 10))


def brute_force_cost(num_blocks: list[int], bucket_cost: int, max_buckets: int) -> int:
    """Cheapest split of the sorted lengths into at most max_buckets runs, by trying every split."""
    widths = sorted(num_blocks, reverse=True)
    best = None
    for num_cuts in range(min(max_buckets, len(widths))):
        for cuts in itertools.combinations(range(1, len(widths)), num_cuts):
            bounds = [0, *cuts, len(widths)]
            cost = sum(bucket_cost + widths[a] * (b - a) for a, b in itertools.pairwise(bounds))
            best = cost if best is None else min(best, cost)
    return best


def plan_cost(num_blocks: list[int], plan: list[list[int]], bucket_cost: int) -> int:
    return sum(bucket_cost + max(num_blocks[i] for i in b) * len(b) for b in plan)


@pytest.mark.parametrize("seed", range(30))
def test_plan_is_cheapest_split(seed: int) -> None:
    rng = random.Random(seed)
    num_blocks = [rng.choice([1, 2, 3, 5, 8, 13, 21, 40]) for _ in range(rng.randint(1, 9))]
    cost = rng.choice([0, 2, 8, 30])
    plan = plan_decode_buckets(num_blocks, max_buckets=len(num_blocks), bucket_cost=cost)
    assert sorted(i for b in plan for i in b) == list(range(len(num_blocks)))
    assert plan_cost(num_blocks, plan, cost) == brute_force_cost(num_blocks, cost, len(num_blocks))


def test_plan_respects_bucket_cap() -> None:
    num_blocks = list(range(1, 31))  # free buckets would give every length its own
    plan = plan_decode_buckets(num_blocks, max_buckets=3, bucket_cost=0)
    assert len(plan) == 3
    assert sorted(i for b in plan for i in b) == list(range(30))
    # merging the cheapest neighbours keeps the buckets sorted runs of lengths
    assert [sorted(num_blocks[i] for i in b) for b in plan] == sorted(
        [sorted(num_blocks[i] for i in b) for b in plan], reverse=True
    )
    with pytest.raises(ValueError, match="max_buckets=0"):
        plan_decode_buckets(num_blocks, max_buckets=0)


def test_plan_keeps_a_lone_outlier_apart() -> None:
    plan = plan_decode_buckets([2] * 20 + [100])
    assert plan == [[20], list(range(20))]
