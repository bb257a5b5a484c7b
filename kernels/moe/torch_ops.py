"""PyTorch twin of the Triton grouped GEMM (grouped_triton.py): one matmul per expert that has rows."""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.moe.checks import check_grouped, check_offsets


def grouped_gemm_torch(x: Tensor, w: Tensor, expert_offsets: Tensor) -> Tensor:
    """x [M, K] sorted by expert, w [E, N, K], offsets [E + 1] int64 -> y [M, N], y[r] = x[r] @ w[e].T.

    Empty experts are skipped (no matmul is launched for them). Accumulates in fp32 and returns x's dtype.
    """
    check_grouped(x, w, expert_offsets)
    bounds = check_offsets(expert_offsets, x.shape[0])
    out = x.new_empty(x.shape[0], w.shape[1])
    wide = x.dtype != torch.float32 and x.device.type == "cpu"
    for expert, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if start == end:
            continue
        rows, weight = x[start:end], w[expert]
        if wide:  # CPU 16-bit GEMMs may round partial sums; the contract is fp32 accumulation
            out[start:end] = (rows.float() @ weight.float().T).to(x.dtype)
        else:
            torch.matmul(rows, weight.T, out=out[start:end])
    return out
