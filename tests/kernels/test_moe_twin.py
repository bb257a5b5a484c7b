"""The MoE grouped-GEMM twin and the routing against float64 loops (kernels/moe)."""

from __future__ import annotations

import pytest
import torch

from kernels.moe import grouped_gemm
from kernels.moe.routing import combine, route
from kernels.moe.torch_ops import grouped_gemm_torch


def _reference(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    bounds = offsets.tolist()
    for expert in range(w.shape[0]):
        for row in range(bounds[expert], bounds[expert + 1]):
            out[row] = x[row].double() @ w[expert].double().T
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_matches_a_float64_loop_with_empty_experts(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(13, 24).to(dtype)
    w = torch.randn(6, 10, 24).to(dtype)
    offsets = torch.tensor([0, 3, 3, 3, 9, 13, 13])  # experts 1, 2 and 5 have no rows
    out = grouped_gemm(x, w, offsets)
    assert out.dtype == dtype and out.shape == (13, 10)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), _reference(x, w, offsets), rtol=tol, atol=tol * 10)


def test_grouped_gemm_refuses_bad_offsets() -> None:
    x, w = torch.randn(4, 8), torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"expected \[3\]"):
        grouped_gemm_torch(x, w, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"rise from 0 to M=4"):
        grouped_gemm_torch(x, w, torch.tensor([0, 3, 2]))
    with pytest.raises(ValueError, match=r"expected \[M, 8\]"):
        grouped_gemm_torch(torch.randn(4, 7), w, torch.tensor([0, 2, 4]))


@pytest.mark.parametrize("renormalize", [False, True])
def test_routing_sorts_pairs_by_expert_and_combines_like_a_loop(renormalize: bool) -> None:
    torch.manual_seed(1)
    logits, top_k = torch.randn(9, 8), 3
    routing = route(logits, top_k, renormalize)
    bounds = routing.expert_offsets.tolist()
    probs = torch.softmax(logits.double(), -1)
    weights, experts = torch.topk(probs, top_k, -1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    for expert in range(8):  # each expert's segment: its tokens, in token order
        tokens = routing.token_ids[bounds[expert] : bounds[expert + 1]].tolist()
        assert tokens == [t for t in range(9) if expert in experts[t].tolist()]
    values = torch.randn(9 * top_k, 5)  # one output per sorted pair
    want = torch.zeros(9, 5, dtype=torch.float64)
    for pos, token in enumerate(routing.token_ids.tolist()):
        expert = next(e for e in range(8) if bounds[e] <= pos < bounds[e + 1])
        slot = experts[token].tolist().index(expert)
        want[token] += weights[token, slot] * values[pos].double()
    torch.testing.assert_close(combine(values, routing, torch.float32).double(), want, rtol=1e-5, atol=1e-6)


def test_combine_keeps_16_bit_outputs_with_fp32_gates() -> None:
    """Mixtral's gates stay fp32 on a bf16 model: each gated output is rounded back to bf16 and the
    token sums its slots in bf16 (this crashed on the fp32 product's dtype before)."""
    torch.manual_seed(2)
    routing = route(torch.randn(6, 4), 2, True)
    values = torch.randn(12, 8).to(torch.bfloat16)
    got = combine(values, routing, torch.float32)
    assert got.dtype == torch.bfloat16
    weighted = (values.float() * routing.gates[:, None]).to(torch.bfloat16)
    unsorted = torch.empty_like(weighted)
    unsorted[routing.order] = weighted
    assert torch.equal(got, unsorted.view(6, 2, 8)[:, 0] + unsorted.view(6, 2, 8)[:, 1])
