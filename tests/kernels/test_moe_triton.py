"""The Triton grouped MoE GEMM under TRITON_INTERPRET=1, against a float64 loop and the torch twin.

Shapes stay small (the interpreter runs each program in numpy); ragged tails on every axis: M not a
multiple of BLOCK_M, N and K not multiples of their blocks. Real compilation: test_moe_compile_nvidia.py,
and on a GPU test_moe_gpu.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from kernels.moe.grouped_triton import grouped_gemm, tile_schedule
from kernels.moe.torch_ops import grouped_gemm_torch
from tests.kernels.moe_reference import POPULARITIES, assert_close_to, make_moe_case, reference

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CASES = [  # (popularity, M, E, N, K, dtype); M = 37 / 50 are not multiples of BLOCK_M = 16
    (pop, rows, 6, n, k, dtype)
    for i, pop in enumerate(POPULARITIES)
    for rows, n, k, dtype in [(37, 24, 40, DTYPES[i % 3]), (50, 80, 150, DTYPES[(i + 1) % 3])]
]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: f"{c[0]}-M{c[1]}-N{c[3]}-K{c[4]}-{str(c[5])[6:]}")
def test_matches_float64_loop_and_the_twin(cfg: tuple) -> None:
    popularity, rows, experts, n, k, dtype = cfg
    case = make_moe_case(popularity, rows, experts, n, k, dtype, seed=rows + n)
    out = grouped_gemm(case.x, case.w, case.offsets)
    assert out.dtype == dtype and out.shape == (rows, n)
    assert_close_to(out, reference(case), case)
    assert_close_to(out, grouped_gemm_torch(case.x, case.w, case.offsets), case)


@pytest.mark.parametrize("blocks", [(16, 16, 16), (32, 16, 64)])
def test_other_block_sizes_and_a_single_row(blocks: tuple[int, int, int]) -> None:
    for rows in (1, 33):
        case = make_moe_case("zipf", rows, 5, 20, 36, torch.float32, seed=rows)
        assert_close_to(grouped_gemm(case.x, case.w, case.offsets, blocks=blocks), reference(case), case)


def test_zero_rows_give_an_empty_output() -> None:
    x, w = torch.randn(0, 8), torch.randn(3, 16, 8)
    assert grouped_gemm(x, w, torch.zeros(4, dtype=torch.int64)).shape == (0, 16)


def test_schedule_maps_tiles_to_experts_and_skips_empty_ones() -> None:
    experts, rows = tile_schedule(torch.tensor([0, 3, 3, 20, 20]), 20, 16)
    assert experts.tolist() == [0, 2, 2, -1, -1, -1]  # expert 1 and 3 have no rows: no tile
    assert rows.tolist()[:3] == [0, 3, 19]


def test_a_row_does_not_depend_on_the_rest_of_the_batch() -> None:
    """Deterministic and batch-invariant: fixed blocks and K order, one writer per output, no atomics."""
    case = make_moe_case("skewed", 45, 4, 24, 40, torch.float32, seed=3)
    full = grouped_gemm(case.x, case.w, case.offsets)
    assert torch.equal(full, grouped_gemm(case.x, case.w, case.offsets))
    bounds = case.offsets.tolist()
    expert = max(range(4), key=lambda e: bounds[e + 1] - bounds[e])
    start, end = bounds[expert], bounds[expert + 1]
    alone = torch.zeros(5, dtype=torch.int64)
    alone[expert + 1 :] = end - start - 1
    part = grouped_gemm(case.x[start + 1 : end], case.w, alone)  # the expert's rows but the first, alone
    assert torch.equal(part, full[start + 1 : end])


def test_bad_input_is_refused_by_name() -> None:
    x, w, off = torch.randn(4, 8), torch.randn(2, 3, 8), torch.tensor([0, 2, 4])
    with pytest.raises(ValueError, match=r"expected \[3\]"):
        grouped_gemm(x, w, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"rise from 0 to M=4"):
        grouped_gemm(x, w, torch.tensor([0, 3, 2]))
    with pytest.raises(ValueError, match=r"rise from 0 to M=4"):
        grouped_gemm(x, w, torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match=r"expected \[M, 8\]"):
        grouped_gemm(torch.randn(4, 7), w, off)
    with pytest.raises(ValueError, match="expected torch.int64"):
        grouped_gemm(x, w, off.int())
    with pytest.raises(ValueError, match="expected x's dtype"):
        grouped_gemm(x, w.double(), off)
    with pytest.raises(ValueError, match=r"w must be a 3-D tensor"):
        grouped_gemm(x, w[0], off)
    with pytest.raises(ValueError, match=">= 16"):
        grouped_gemm(x, w, off, blocks=(8, 16, 16))


def test_needs_cuda_or_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    # The environment, not the knob: setting triton.knobs.runtime.interpret pins it for later tests.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        grouped_gemm(torch.randn(2, 8), torch.randn(1, 4, 8), torch.tensor([0, 2]))
