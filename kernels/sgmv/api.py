"""Public SGMV ops: `add_lora` and its building blocks `sgmv_shrink` / `sgmv_expand`.

Punica's shrink/expand split (Chen et al., "Punica: Multi-Tenant LoRA Serving", MLSys 2024) with
vLLM-style stacked slot weights and horizontally fused slices (q/k/v, gate/up). Each op checks its
arguments once, builds the batch metadata if the caller did not, and dispatches to the Triton
kernels (`triton_ops`) or their PyTorch twin (`torch_ops`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from kernels.sgmv import torch_loop, torch_ops
from kernels.sgmv.checks import (
    LoraLayout,
    SlotParams,
    check_lora_a,
    check_lora_b,
    check_lora_b_alone,
    check_matrix,
    check_meta,
    check_out_vectors,
    check_tensors,
    slot_params,
)
from kernels.sgmv.layout import stack_memo
from kernels.sgmv.meta import SgmvMeta, build_meta

Backend = Literal["auto", "triton", "torch"]
BACKENDS = ("auto", "triton", "torch")


def _triton_interprets() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1, read by Triton itself)."""
    import triton.knobs

    return bool(triton.knobs.runtime.interpret)


def _resolve_backend(backend: str, x: Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}, expected one of {BACKENDS}")
    if backend == "auto":
        return "triton" if x.is_cuda else "torch"
    if backend == "triton" and not x.is_cuda and not _triton_interprets():
        raise ValueError(f"backend='triton' needs CUDA tensors (x is on {x.device}) or TRITON_INTERPRET=1")
    return backend


def _meta_for(
    meta: SgmvMeta | None, token_slots: Tensor, num_tokens: int, num_slots: int, device: torch.device
) -> SgmvMeta:
    if not isinstance(token_slots, Tensor) or tuple(token_slots.shape) != (num_tokens,):
        shape = tuple(token_slots.shape) if isinstance(token_slots, Tensor) else type(token_slots).__name__
        raise ValueError(f"token_slots has shape {shape}, expected [{num_tokens}] (one slot per row of x)")
    if meta is None:
        if token_slots.device != device:
            raise ValueError(f"token_slots is on {token_slots.device}, expected {device} like x")
        return build_meta(token_slots, num_slots)
    check_meta(meta, num_tokens, num_slots, device)
    return meta


def _checked_stacks(lora_a: Sequence[Tensor], lora_b: Sequence[Tensor], x: Tensor) -> LoraLayout:
    """Shapes, dtypes and devices of both stacks against x; remembered per pair of stacks (stack_memo),
    since the engine hands the same slot-pool tensors to every call."""
    memo = stack_memo(lora_a, lora_b)
    key = ("layout", x.dtype, x.device)
    if memo is not None and key in memo:
        return memo[key]
    layout = check_lora_a(lora_a)
    check_tensors({f"lora_a[{s}]": w for s, w in enumerate(lora_a)}, x.device, x.dtype, "x")
    out_sizes = check_lora_b(lora_b, layout.num_slices, layout.num_slots, layout.max_rank)
    check_tensors({f"lora_b[{s}]": w for s, w in enumerate(lora_b)}, x.device, x.dtype, "x")
    layout = LoraLayout(layout.num_slices, layout.num_slots, layout.max_rank, layout.hidden_in, out_sizes)
    if memo is not None:
        memo[key] = layout
    return layout


def _prepare_a(
    x: Tensor,
    lora_a: Sequence[Tensor],
    token_slots: Tensor,
    scales: Tensor,
    ranks: Tensor | None,
    meta: SgmvMeta | None,
) -> tuple[LoraLayout, SgmvMeta, SlotParams]:
    layout = check_lora_a(lora_a)
    check_matrix("x", x, None, layout.hidden_in)
    check_tensors({f"lora_a[{s}]": w for s, w in enumerate(lora_a)}, x.device, x.dtype, "x")
    params = slot_params(scales, ranks, layout, x.device, may_sync=meta is None)
    return layout, _meta_for(meta, token_slots, x.shape[0], layout.num_slots, x.device), params


def add_lora(
    y: Tensor,
    x: Tensor,
    lora_a: Sequence[Tensor],
    lora_b: Sequence[Tensor],
    token_slots: Tensor,
    *,
    scales: Tensor,
    ranks: Tensor | None = None,
    meta: SgmvMeta | None = None,
    out_scale: Tensor | None = None,
    out_shift: Tensor | None = None,
    backend: Backend = "auto",
) -> None:
    """Add every row's own LoRA delta to y, in place (then, with out_scale, rescale the row: DoRA).

    Semantics:
        add_lora(y, x, lora_a, lora_b, token_slots, *, scales, ranks=None, meta=None, backend="auto") -> None
          x:           [T, H_in]
          y:           [T, sum(H_out_s)]   updated in place
          lora_a:      list of S tensors, lora_a[s]: [N, R_max, H_in]     (S output slices, e.g. q/k/v)
          lora_b:      list of S tensors, lora_b[s]: [N, H_out_s, R_max]
          token_slots: [T] int (-1 = no adapter for this row)
          scales:      [N] or [S, N] float32 (per slot, or per slice and slot)
          ranks:       [N] or [S, N] int, default R_max; entries of lora_a/lora_b beyond a slot's rank are never read
                       (they may hold garbage or NaN), so adapters of different ranks share one batch without
                       padding compute
          for each row t with a = token_slots[t] >= 0 and each slice s (output columns off_s : off_s + H_out_s):
              y[t, off_s:off_s+H_out_s] += scale(s,a) * (x[t] @ lora_a[s][a, :r(s,a)].T) @ lora_b[s][a, :, :r(s,a)].T
          out_scale:   [N, sum(H_out_s)] float32 or None; out_shift: the same or None (only with out_scale)
          with out_scale, after the delta, each row t with a = token_slots[t] >= 0 (all slices' columns):
              y[t] = out_scale[a] * y[t] + out_shift[a]     (in fp32 from y + delta, one rounding on Triton)
          rows with token_slots[t] == -1, and columns of y outside the slices, are left bit-identical

    A slot whose out_scale row is 1 and out_shift row 0 (plain LoRA) gets exactly the plain result. DoRA
    (Liu et al. 2024, arXiv:2402.09353) is m / ||W + s B A||_row as out_scale, (1 - out_scale) * bias as
    out_shift (the bias is not rescaled), both precomputed per slot by the caller.
    x and y may be strided 2-D views (y a column slice of a fused output buffer); x, y and the weights
    share one dtype (fp16, bf16 or fp32) and device. Pass `meta=build_meta(token_slots, N)` built once per
    step: then nothing here reads device memory (ranks on the device are then clamped to R_max, not checked).
    backend: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch" (the twin), "auto" (Triton on CUDA).
    Raises ValueError on any shape/dtype/device mismatch, slot outside [-1, N) or rank outside [0, R_max].
    """  # noqa: E501 (the Semantics block is the issue's, verbatim)
    layout = _checked_stacks(lora_a, lora_b, x)
    check_matrix("x", x, None, layout.hidden_in)
    check_matrix("y", y, x.shape[0], sum(layout.out_sizes))
    check_tensors({"y": y}, x.device, x.dtype, "x")
    params = slot_params(scales, ranks, layout, x.device, may_sync=meta is None)
    check_out_vectors(out_scale, out_shift, layout.num_slots, sum(layout.out_sizes), x.device)
    meta = _meta_for(meta, token_slots, x.shape[0], layout.num_slots, x.device)
    if meta.num_active_rows == 0:
        return
    if _resolve_backend(backend, x) == "torch":
        torch_ops.add_lora_torch(y, x, lora_a, lora_b, meta, params, layout)
        if out_scale is not None:
            torch_loop.rescale_rows(y, meta, out_scale, out_shift)
        return
    if meta.invariant:
        raise ValueError("meta.invariant: the Triton kernels split their reductions; use the torch backend")
    from kernels.sgmv import triton_ops  # imported on first use: TRITON_INTERPRET is read at import

    v = triton_ops.shrink(x, lora_a, meta, params, layout)
    triton_ops.expand(y, v, lora_b, meta, params, layout, out_scale=out_scale, out_shift=out_shift)


def sgmv_shrink(
    x: Tensor,
    lora_a: Sequence[Tensor],
    token_slots: Tensor,
    *,
    scales: Tensor,
    ranks: Tensor | None = None,
    meta: SgmvMeta | None = None,
    backend: Backend = "auto",
) -> Tensor:
    """First half of add_lora: x -> the fp32 low-rank intermediate.

    Semantics:
        sgmv_shrink(x, lora_a, token_slots, *, scales, ranks=None, meta=None, backend="auto") -> v
          x: [T, H_in]; lora_a[s]: [N, R_max, H_in]; scales, ranks as in add_lora
          v: [S, T, R_max] float32, zero everywhere except
              v[s, t, :r(s,a)] = scale(s,a) * x[t] @ lora_a[s][a, :r(s,a)].T   for a = token_slots[t] >= 0
    """
    layout, meta, params = _prepare_a(x, lora_a, token_slots, scales, ranks, meta)
    if _resolve_backend(backend, x) == "torch":
        return torch_ops.sgmv_shrink_torch(x, lora_a, meta, params, layout)
    from kernels.sgmv import triton_ops

    return triton_ops.shrink(x, lora_a, meta, params, layout)


def sgmv_expand(
    y: Tensor,
    v: Tensor,
    lora_b: Sequence[Tensor],
    token_slots: Tensor,
    *,
    ranks: Tensor | None = None,
    meta: SgmvMeta | None = None,
    backend: Backend = "auto",
) -> None:
    """Second half of add_lora: the intermediate -> y, in place (scales were applied by the shrink).

    Semantics:
        sgmv_expand(y, v, lora_b, token_slots, *, ranks=None, meta=None, backend="auto") -> None
          v: [S, T, R_max] float32; lora_b[s]: [N, H_out_s, R_max]; y: [T, sum(H_out_s)]
          for each row t with a = token_slots[t] >= 0 and each slice s:
              y[t, off_s:off_s+H_out_s] += v[s, t, :r(s,a)] @ lora_b[s][a, :, :r(s,a)].T
          v[s, t, r(s,a):] is never read; -1 rows and columns outside y are left bit-identical
    """
    layout = check_lora_b_alone(lora_b)
    check_matrix("y", y, None, sum(layout.out_sizes))
    check_tensors({f"lora_b[{s}]": w for s, w in enumerate(lora_b)}, y.device, y.dtype, "y")
    want = (layout.num_slices, y.shape[0], layout.max_rank)
    if not isinstance(v, Tensor) or tuple(v.shape) != want:
        shape = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
        raise ValueError(f"v has shape {shape}, expected [S, T, R_max] = {list(want)}")
    if v.device != y.device or v.dtype != torch.float32:
        raise ValueError(f"v is {v.dtype} on {v.device}, expected torch.float32 on {y.device} like y")
    ones = torch.ones(layout.num_slots, dtype=torch.float32, device=y.device)
    params = slot_params(ones, ranks, layout, y.device, may_sync=meta is None)
    meta = _meta_for(meta, token_slots, y.shape[0], layout.num_slots, y.device)
    if _resolve_backend(backend, y) == "torch":
        torch_ops.sgmv_expand_torch(y, v, lora_b, meta, params, layout)
        return
    from kernels.sgmv import triton_ops

    triton_ops.expand(y, v, lora_b, meta, params, layout)
