"""The Triton kernels, run by Triton's CPU interpreter (TRITON_INTERPRET=1, set in tests/conftest.py).

Interpreted programs are slow, so shapes stay small and the grid is sampled: every popularity x dtype
cell once, plus edge cases; the wide grid runs on the torch twin (test_torch_twin.py) and, with real
compilation at Llama shapes, in test_gpu.py.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch

from kernels.sgmv import build_meta, sgmv_expand, sgmv_shrink
from tests.kernels.reference import (
    POPULARITIES,
    assert_matches,
    case_id,
    check_rank_zero,
    check_shrink,
    expected_output,
    make_case,
    poisoned,
    run_add_lora,
    small_case,
)

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
AXES = {
    "num_tokens": (1, 5, 16, 33, 64, 128),
    "hidden_in": (16, 37, 64, 100),
    "out_sizes": ((16,), (37,), (24, 8), (24, 8, 9)),
    "num_slots": (1, 3, 8, 16),
    "max_rank": (1, 4, 16, 33, 64),
    "per_slice": (True, False),
    "shuffle": (True, False),
}


def grid(per_cell: int, seed: int) -> list[dict]:
    """Every popularity x dtype cell `per_cell` times, the other axes drawn with a fixed seed."""
    rng = random.Random(seed)
    cells = itertools.product(POPULARITIES, DTYPES)
    return [
        {"popularity": pop, "dtype": dtype, "seed": 7 * i + j}
        | {axis: rng.choice(v) for axis, v in AXES.items()}
        for i, (pop, dtype) in enumerate(cells)
        for j in range(per_cell)
    ]


EDGES = [  # the larger corners of the grid, fp32 only to keep the interpreter quick
    {"popularity": "distinct", "num_tokens": 128, "num_slots": 16, "max_rank": 8, "hidden_in": 16},
    {"popularity": "zipf", "num_tokens": 64, "num_slots": 16, "max_rank": 64, "hidden_in": 32},
    {"popularity": "skewed", "num_tokens": 100, "num_slots": 2, "max_rank": 16, "hidden_in": 67},
]
GRID = grid(per_cell=2, seed=11) + [
    {"dtype": torch.float32, "seed": 90 + i, "out_sizes": (16, 8, 8), "per_slice": True} | edge
    for i, edge in enumerate(EDGES)
]


@pytest.mark.parametrize("cfg", GRID, ids=[case_id(c) for c in GRID])
def test_add_lora_matches_float64_loop(cfg: dict) -> None:
    case = make_case(**cfg)
    expected, before = expected_output(case), case.buf.clone()
    run_add_lora(case, "triton", meta=build_meta(case.token_slots, case.lora_a[0].shape[0]))
    assert_matches(case, expected, before, cfg["dtype"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_building_blocks_match_oracle(dtype: torch.dtype) -> None:
    case = small_case(
        num_tokens=11, out_sizes=(16, 8, 9), max_rank=16, popularity="uniform", dtype=dtype, seed=3
    )
    v = sgmv_shrink(
        case.x, case.lora_a, case.token_slots, scales=case.scales, ranks=case.ranks, backend="triton"
    )
    check_shrink(case, v)
    expected, before = expected_output(case), case.buf.clone()
    sgmv_expand(case.y, poisoned(v), case.lora_b, case.token_slots, ranks=case.ranks, backend="triton")
    assert_matches(case, expected, before, dtype)


def test_split_k_shrink_accumulates_partial_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels.sgmv import triton_ops

    monkeypatch.setattr(triton_ops, "_default_split_k", lambda *args: 3)  # 3 K-splits over 3 x 16 columns
    case = small_case(hidden_in=48, max_rank=16, popularity="zipf", num_tokens=10, seed=8)
    v = sgmv_shrink(
        case.x, case.lora_a, case.token_slots, scales=case.scales, ranks=case.ranks, backend="triton"
    )
    check_shrink(case, v)


def test_rank_zero_adds_nothing_and_reads_nothing() -> None:
    check_rank_zero("triton")


def test_more_slices_than_one_launch() -> None:
    case = small_case(out_sizes=(8, 11, 14, 17), popularity="distinct", num_tokens=6, seed=4)
    expected, before = expected_output(case), case.buf.clone()
    run_add_lora(case, "triton")
    assert_matches(case, expected, before, torch.float32)


def test_zero_tokens_and_all_rows_without_adapter_are_no_ops() -> None:
    for tokens in (0, 7):
        case = small_case(num_tokens=tokens, popularity="all_none")
        before = case.buf.clone()
        run_add_lora(case, "triton")
        assert torch.equal(case.buf, before)


def test_triton_needs_cuda_or_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    case = small_case()
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        run_add_lora(case, "triton")
