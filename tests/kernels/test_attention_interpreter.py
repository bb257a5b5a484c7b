"""The Triton paged attention kernels, run by Triton's CPU interpreter (TRITON_INTERPRET=1, set in
tests/conftest.py), against the float64 loop oracle; every case also runs on a pool whose unreadable
slots hold NaN/Inf and must give bit-identical rows.

Interpreted programs are slow, so shapes stay small and the grid is sampled: every dtype x GQA group
cell once per kernel, the other axes (block size 16/32, head_dim 64/128, KV heads, sliding window,
splits, row indirection, int32/int64 tables) drawn with a fixed seed, with tiles smaller than on a GPU
so that every case crosses several key tiles. Real compilation: test_attention_compile_nvidia.py (sm_90)
and, on a GPU, test_attention_gpu.py.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch

from kernels.attention import paged_decode_attention, triton_ops
from tests.kernels.attention_cases import decode_case, mixed_lengths, prefill_case
from tests.kernels.attention_oracle import (
    case_id,
    check_decode,
    check_prefill,
    decode_oracle,
    one_thread,
    run_decode,
)

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"),
    pytest.mark.usefixtures(one_thread.__name__),
]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
GROUPS = (1, 2, 4)


def grid(seed: int) -> list[dict]:
    rng = random.Random(seed)
    cases = []
    for i, (dtype, group) in enumerate(itertools.product(DTYPES, GROUPS)):
        cases.append(
            {
                "dtype": dtype,
                "group": group,
                "block_size": (16, 32)[i % 2],
                "head_dim": (64, 128)[(i // 2) % 2],
                "window": (None, 24)[(i // 3) % 2] if i < 6 else rng.choice((None, 40)),
                "num_kv_heads": rng.choice((1, 2)),
                "seed": 100 + i,
            }
        )
    return cases


DECODE_GRID = grid(seed=3)
PREFILL_GRID = grid(seed=4)


@pytest.mark.parametrize("cfg", DECODE_GRID, ids=[case_id(c) for c in DECODE_GRID])
def test_decode_kernel_matches_float64_loop(cfg: dict) -> None:
    rng = random.Random(cfg["seed"])
    lengths = mixed_lengths(4, cfg["block_size"], longest=90, rng=rng)
    case = decode_case(lengths, with_rows=cfg["seed"] % 2 == 1, **cfg)
    # splits 1 (direct store) or 3 (partials + merge; uneven, some splits of short rows empty)
    num_splits = (1, 3)[cfg["seed"] % 2]
    check_decode(case, "triton", num_splits=num_splits)


# Soft-capped scores (Gemma 2): fp32 and bf16, a window on one, splits on the decode.
SOFTCAP_GRID = [
    {"dtype": torch.float32, "group": 2, "window": None, "softcap": 0.7, "seed": 61},
    {"dtype": torch.bfloat16, "group": 4, "window": 24, "softcap": 1.3, "seed": 62, "num_kv_heads": 1},
]


@pytest.mark.parametrize("cfg", SOFTCAP_GRID, ids=[case_id(c) for c in SOFTCAP_GRID])
def test_softcapped_kernels_match_float64_loop(cfg: dict) -> None:
    rng = random.Random(cfg["seed"])
    check_decode(decode_case(mixed_lengths(4, 16, longest=70, rng=rng), **cfg), "triton", num_splits=3)
    check_prefill(prefill_case([(0, 13), (37, 20), (32, 1)], **cfg), "triton")


@pytest.mark.parametrize("cfg", PREFILL_GRID, ids=[case_id(c) for c in PREFILL_GRID])
def test_prefill_kernel_matches_float64_loop(cfg: dict) -> None:
    rng = random.Random(cfg["seed"])
    bs = cfg["block_size"]
    # a first chunk, a chunk after an unaligned prefix (some longer than the window, so queries lose
    # their own chunk's first keys), a single token after a block-aligned prefix
    chunks = [(0, rng.randint(5, 24)), (rng.randint(bs + 1, 70), rng.randint(18, 34)), (2 * bs, 1)]
    check_prefill(prefill_case(chunks, **cfg), "triton")


def test_prefill_with_small_tiles_and_groups_of_three() -> None:
    """Tiles of 16 rows (5 queries x 3 heads, one padding row), 16 keys: many tiles per chunk."""
    case = prefill_case([(37, 23), (0, 16)], group=3, num_kv_heads=1, window=13, seed=9)

    def launch(q, k, v, kv_cache, block_tables, query_starts, query_lens, seq_lens, *, scale,
               sliding_window, max_query_len, out):  # fmt: skip
        triton_ops.prefill(
            q, k, v, kv_cache, block_tables, query_starts, query_lens, seq_lens, out, scale=scale,
            sliding_window=sliding_window, max_query_len=max_query_len, block_m=16, block_n=16,
        )  # fmt: skip

    from tests.kernels.attention_oracle import prefill_oracle

    for poisoned in (False, True):
        pool = case.pool
        cache, tables = (pool.poisoned, pool.block_tables) if poisoned else (pool.clean, pool.clean_tables)
        out = torch.full_like(case.q, float("nan"))
        launch(case.q, case.k, case.v, cache, tables, case.query_starts, case.query_lens, case.seq_lens,
               scale=case.scale, sliding_window=case.window, max_query_len=23, out=out)  # fmt: skip
        inside = case.chunk_rows
        if not poisoned:
            clean = out
            want = prefill_oracle(case)
            assert (out[inside] - want[inside].float()).abs().max() < 2e-5
            assert out[~inside].isnan().all()
        else:
            assert torch.equal(out[inside], clean[inside])


@pytest.mark.parametrize("num_splits", [1, 4])
def test_zero_length_rows_read_nothing_and_get_zeros(num_splits: int) -> None:
    """CUDA-graph padding rows: seq_len 0, any table; a long row next to them is unaffected."""
    case = decode_case([0, 75, 0, 2], group=4, seed=11)
    got = run_decode(case, "triton", poisoned=True, num_splits=num_splits)
    assert torch.equal(got[0], torch.zeros_like(got[0])) and torch.equal(got[2], torch.zeros_like(got[2]))
    want = decode_oracle(case)
    assert (got[[1, 3]] - want[[1, 3]].float()).abs().max() < 2e-5


def test_decode_rows_leave_other_rows_untouched_and_take_int32_indices() -> None:
    case = decode_case([40, 17, 1], group=2, window=20, with_rows=True, seed=12)
    out = torch.full_like(case.q, 7.0)
    paged_decode_attention(
        case.q, case.pool.poisoned, case.pool.block_tables.int(), case.seq_lens.int(), scale=case.scale,
        sliding_window=20, rows=case.rows.int(), out=out, num_splits=2, backend="triton",
    )  # fmt: skip
    others = torch.ones(out.shape[0], dtype=torch.bool)
    others[case.rows] = False
    assert (out[others] == 7.0).all()
    assert (out[case.rows] - decode_oracle(case).float()).abs().max() < 2e-5


def test_splits_agree_with_one_split() -> None:
    case = decode_case([130, 64, 5], group=2, block_size=16, seed=13)
    one = run_decode(case, "triton", poisoned=False, num_splits=1)
    for splits in (2, 5):
        assert (run_decode(case, "triton", poisoned=True, num_splits=splits) - one).abs().max() < 1e-5


def test_head_dim_not_a_power_of_two() -> None:
    """head_dim 80 (Phi-like): BLOCK_D 128 with masked columns, through the split merge and prefill."""
    check_decode(decode_case([50, 7, 33], group=2, head_dim=80, seed=14), "triton", num_splits=3)
    check_prefill(prefill_case([(20, 9), (0, 6)], group=2, head_dim=80, window=16, seed=15), "triton")
