"""The grouped MoE GEMM compiled on a CUDA GPU at real MoE shapes (skipped without CUDA; run by
benchmarks/gpu_check.sh): Qwen3-30B-A3B (128 experts, gate_up 1536 x 2048, down 2048 x 768) and Mixtral
(8 experts, 28672 x 4096), decode to prefill row counts, every popularity, against the float64 loop.
Also: the schedule needs no host sync, so the call replays in a CUDA graph with new routing.
"""

from __future__ import annotations

import pytest
import torch

from kernels.moe.grouped_triton import grouped_gemm
from kernels.moe.torch_ops import grouped_gemm_torch
from tests.kernels.moe_reference import POPULARITIES, assert_close_to, make_moe_case, reference

pytestmark = pytest.mark.gpu

QWEN3_GATE_UP, QWEN3_DOWN, MIXTRAL = (128, 1536, 2048), (128, 2048, 768), (8, 28672, 4096)  # (E, N, K)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GRID = [  # (popularity, M = tokens x top-k, E, N, K, dtype)
    (POPULARITIES[i % len(POPULARITIES)], rows, *shape, DTYPES[i % len(DTYPES)])
    for i, (rows, shape) in enumerate(
        [(1, QWEN3_GATE_UP), (8, QWEN3_DOWN), (37, MIXTRAL), (256, QWEN3_GATE_UP), (1000, QWEN3_DOWN),
         (333, MIXTRAL), (2048, QWEN3_GATE_UP), (4, MIXTRAL), (517, QWEN3_DOWN)]
    )
]  # fmt: skip


@pytest.mark.parametrize("cfg", GRID, ids=lambda c: f"{c[0]}-M{c[1]}-E{c[2]}-N{c[3]}-K{c[4]}-{str(c[5])[6:]}")
def test_triton_matches_float64_at_moe_shapes(cfg: tuple) -> None:
    popularity, rows, experts, n, k, dtype = cfg
    case = make_moe_case(popularity, rows, experts, n, k, dtype, seed=rows, device="cuda")
    out = grouped_gemm(case.x, case.w, case.offsets)
    assert_close_to(out, reference(case), case)
    assert_close_to(out, grouped_gemm_torch(case.x, case.w, case.offsets), case)


def test_replays_in_a_cuda_graph_with_new_routing() -> None:
    first = make_moe_case("zipf", 96, 16, 256, 512, torch.bfloat16, seed=1, device="cuda")
    second = make_moe_case("skewed", 96, 16, 256, 512, torch.bfloat16, seed=2, device="cuda")
    x, offsets = first.x.clone(), first.offsets.clone()
    grouped_gemm(x, first.w, offsets)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_gemm(x, first.w, offsets)
    x.copy_(second.x)
    offsets.copy_(second.offsets)
    graph.replay()
    torch.cuda.synchronize()
    replayed = type(second)(second.x, first.w, second.offsets)
    assert_close_to(out, reference(replayed), replayed)
