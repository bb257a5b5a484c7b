"""The float64 oracle of tests/kernels/attention_oracle.py pinned to the engine's torch path
(base_engine.runner.attention), so kernels and engine mean the same thing; and the poisoned pools it builds
keep every readable slot and poison the rest.

The case generators live in attention_cases.py, the oracle and the checks in attention_oracle.py;
they are re-exported here for the kernel tests that import them from this module.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import Tensor

from tests.kernels.attention_cases import decode_case, prefill_case
from tests.kernels.attention_oracle import (
    assert_close,
    decode_oracle,
    prefill_oracle,
)

# --- the oracle against the engine's torch path ------------------------------------------------------


def _engine_attend(
    q: Tensor, k: Tensor, v: Tensor, cache: Tensor, meta, scale: float, softcap=None
) -> Tensor:
    from base_engine.runner.attention import attend

    return attend(q, k, v, cache, meta, scale, softcap)


# (window, softcap): the soft-capped cases take the explicit-ops path instead of SDPA.
CASES = [(None, None), (20, None), (None, 0.8), (20, 1.5)]


@pytest.mark.parametrize(("window", "softcap"), CASES)
def test_decode_oracle_matches_engine_torch_path(window: int | None, softcap: float | None) -> None:
    from base_engine.runner.attention import AttentionMetadata
    from base_engine.runner.decode_buckets import build_decode_buckets

    case = decode_case([37, 1, 16, 70, 5], window=window, softcap=softcap, seed=1)
    tables = [row[row != 0].tolist() for row in case.pool.clean_tables]  # block 0: nobody's
    cache = case.pool.clean.clone()
    cache[:, 0] = 0  # the engine pads short rows of a bucket with a zero "null block"
    extra = {"null_block": 0} if "null_block" in inspect.signature(build_decode_buckets).parameters else {}
    buckets = build_decode_buckets(
        list(range(5)), tables, case.seq_lens.tolist(), block_size=16, sliding_window=window,
        dtype=torch.float32, **extra,
    )  # fmt: skip
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), buckets, [])
    got = _engine_attend(case.q, case.q, case.q, cache, meta, case.scale, softcap)
    assert_close(got, decode_oracle(case), torch.float32)


@pytest.mark.parametrize(("window", "softcap"), CASES)
def test_prefill_oracle_matches_engine_torch_path(window: int | None, softcap: float | None) -> None:
    from base_engine.runner.attention import AttentionMetadata, PrefillChunk, chunk_mask, write_kv

    case = prefill_case([(0, 9), (40, 17), (33, 1)], window=window, softcap=softcap, seed=2)
    cache = case.pool.clean.clone()
    bs = case.pool.block_size
    chunks, slots = [], []
    for n, (start, m, seq_len) in enumerate(
        zip(case.query_starts.tolist(), case.query_lens.tolist(), case.seq_lens.tolist(), strict=True)
    ):
        table = case.pool.clean_tables[n, : -(-seq_len // bs)]
        ctx = seq_len - m
        chunks.append(PrefillChunk(start, m, ctx, table, chunk_mask(ctx, m, window)))
        slots += [int(table[p // bs]) * bs + p % bs for p in range(ctx, seq_len)]
    rows = case.chunk_rows
    # the engine writes the chunk's own K/V to the cache first, then reads the prefix from it
    write_kv(cache, case.k[rows], case.v[rows], torch.tensor(slots, dtype=torch.long))
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), [], chunks)
    got = _engine_attend(case.q, case.k, case.v, cache, meta, case.scale, softcap)
    assert_close(got[rows], prefill_oracle(case)[rows], torch.float32)


def test_poisoned_pool_keeps_readable_slots_and_poisons_the_rest() -> None:
    case = decode_case([40, 3], window=8, seed=3)
    pool = case.pool
    flat = pool.poisoned[0].flatten(0, 1)
    readable = torch.zeros(flat.shape[0], dtype=torch.bool)
    for b, (lo, hi) in enumerate(pool.readable):
        for p in range(lo, hi):
            readable[int(pool.clean_tables[b, p // 16]) * 16 + p % 16] = True
    assert torch.equal(flat[readable], pool.clean[0].flatten(0, 1)[readable])
    assert not torch.isfinite(flat[~readable]).any()
    assert readable.sum() == 8 + 3
    assert (pool.block_tables[0, :2] != pool.clean_tables[0, :2]).all()  # blocks 0, 1 of seq 0: freed
    assert torch.equal(pool.block_tables[0, 2:], pool.clean_tables[0, 2:])
