"""Argument checks for the grouped GEMM, shared by the Triton kernel and the PyTorch twin.

Every failure is a ValueError that names the argument, the value it got and what was expected.
`check_grouped` reads no device memory; `check_offsets` reads the offsets (one device-to-host copy on
CUDA), which the Triton path skips while a CUDA graph is being captured (a sync cannot be captured).
"""

from __future__ import annotations

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_grouped(x: Tensor, w: Tensor, expert_offsets: Tensor) -> None:
    """Shapes, dtypes and devices of x [M, K], w [E, N, K] and expert_offsets [E + 1] int64."""
    if not isinstance(w, Tensor) or w.dim() != 3:
        raise ValueError(f"w must be a 3-D tensor [E, N, K], got {_shape(w)}")
    num_experts, _, k = w.shape
    if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x has shape {_shape(x)}; expected [M, {k}] for w of shape {tuple(w.shape)}")
    if not isinstance(expert_offsets, Tensor) or tuple(expert_offsets.shape) != (num_experts + 1,):
        raise ValueError(f"expert_offsets has shape {_shape(expert_offsets)}; expected [{num_experts + 1}]")
    if expert_offsets.dtype != torch.int64:
        raise ValueError(f"expert_offsets has dtype {expert_offsets.dtype}; expected torch.int64")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x has dtype {x.dtype}; expected one of {FLOAT_DTYPES}")
    if w.dtype != x.dtype:
        raise ValueError(f"w has dtype {w.dtype}; expected x's dtype {x.dtype}")
    if w.device != x.device or expert_offsets.device != x.device:
        raise ValueError(
            "x, w and expert_offsets must share one device; "
            f"got {x.device}, {w.device}, {expert_offsets.device}"
        )


def check_offsets(expert_offsets: Tensor, num_rows: int) -> list[int]:
    """The offsets as host ints, checked to rise (non-strictly) from 0 to M."""
    bounds = expert_offsets.tolist()
    if (
        bounds[0] != 0
        or bounds[-1] != num_rows
        or any(a > b for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    ):
        raise ValueError(f"expert_offsets {bounds} must rise from 0 to M={num_rows}")
    return bounds


def _shape(t: object) -> object:
    return tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
