"""PyTorch twin of the Triton grouped GEMM (grouped_triton.py): one matmul per expert that has rows."""

from __future__ import annotations

import torch
from torch import Tensor


def grouped_gemm_torch(x: Tensor, w: Tensor, expert_offsets: Tensor) -> Tensor:
    """x [M, K] sorted by expert, w [E, N, K], offsets [E + 1] -> y [M, N], y[r] = x[r] @ w[e].T.

    Empty experts are skipped (no matmul is launched for them). Accumulates in fp32 and returns x's dtype.
    """
    num_experts, n, k = w.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected [M, {k}] for w of shape {tuple(w.shape)}")
    if tuple(expert_offsets.shape) != (num_experts + 1,):
        raise ValueError(
            f"expert_offsets has shape {tuple(expert_offsets.shape)}; expected [{num_experts + 1}]"
        )
    out = x.new_empty(x.shape[0], n)
    bounds = expert_offsets.tolist()
    if (
        bounds[0] != 0
        or bounds[-1] != x.shape[0]
        or any(a > b for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    ):
        raise ValueError(f"expert_offsets {bounds} must rise from 0 to M={x.shape[0]}")
    wide = x.dtype != torch.float32 and x.device.type == "cpu"
    for expert, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if start == end:
            continue
        rows, weight = x[start:end], w[expert]
        if wide:  # CPU 16-bit GEMMs may round partial sums; the contract is fp32 accumulation
            out[start:end] = (rows.float() @ weight.float().T).to(x.dtype)
        else:
            out[start:end] = rows @ weight.T
    return out
