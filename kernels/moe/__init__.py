"""Mixture-of-experts ops: routing (routing.py) and the grouped GEMM over experts' row segments.

`grouped_gemm` runs the Triton kernel (grouped_triton.py, imported lazily when present) on CUDA tensors
and the PyTorch twin (torch_ops.py) everywhere else; both share one contract, see `grouped_gemm_torch`.
"""

from __future__ import annotations

import importlib
import importlib.util

from torch import Tensor

from kernels.moe.torch_ops import grouped_gemm_torch


def grouped_gemm(x: Tensor, w: Tensor, expert_offsets: Tensor) -> Tensor:
    """x [M, K] sorted by expert, w [E, N, K], expert_offsets [E + 1] -> [M, N] (x's dtype)."""
    if x.is_cuda and importlib.util.find_spec("kernels.moe.grouped_triton") is not None:
        triton_mod = importlib.import_module("kernels.moe.grouped_triton")
        return triton_mod.grouped_gemm(x, w, expert_offsets)
    return grouped_gemm_torch(x, w, expert_offsets)
