"""Triton grouped GEMM over experts' contiguous row segments (the fused-MoE expert matmuls).

Semantics (the twin's contract, kernels/moe/torch_ops.py):
    for e in range(E):
        for r in range(offsets[e], offsets[e + 1]):
            y[r, :] = (x[r, :].float() @ w[e].float().T).to(x.dtype)   # fp32 accumulation

Layout (one launch; no atomics, so every output is written once by one program):
  * programs (row tile, N tile); a row tile is BLOCK_M rows of one expert. The per-tile schedule
    (tile -> expert, first row) is built on the device by `tile_schedule` (no device-to-host read):
    experts with no rows own no tile, tiles past the last one exit at once;
  * each program loops over K in BLOCK_K steps in a fixed order and accumulates with `tl.dot` in fp32
    (IEEE for fp32 inputs; bf16 tiles are widened only under the CPU interpreter, whose dot reads bf16
    as raw integers), then rounds once to x's dtype. Ragged tails (a segment not a multiple of BLOCK_M,
    N or K not multiples of their blocks) are masked;
  * block sizes depend on (N, K, device) only, never on M or on the routing, so a row's result does not
    depend on the other rows in the batch (deterministic and batch-invariant);
  * blocks are >= 16 on every dot axis, so the same code compiles for tensor cores.
"""

from __future__ import annotations

import torch
import triton
import triton.knobs
import triton.language as tl
from torch import Tensor

from kernels.moe.checks import check_grouped, check_offsets


@triton.jit
def _grouped_kernel(
    x_ptr, stride_xm, stride_xk,
    w_ptr, stride_we, stride_wn, stride_wk,
    y_ptr, stride_ym, stride_yn,
    offsets_ptr, tile_expert_ptr, tile_row_ptr,
    n, k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if expert < 0:  # past the last scheduled tile
        return
    row_start = tl.load(tile_row_ptr + tile)
    row_end = tl.load(offsets_ptr + expert + 1)
    offs_m = row_start + tl.arange(0, BLOCK_M).to(tl.int64)
    m_mask = offs_m < row_end
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m[:, None] * stride_xm  # [BM, 1]
    w_cols = (
        w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
    )  # [1, BN]: w[e, n, :] is column n of w^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(k, BLOCK_K)):
        ks = kk * BLOCK_K + offs_k
        k_mask = ks < k
        xt = tl.load(x_rows + ks[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        wt = tl.load(w_cols + ks[:, None] * stride_wk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            acc = tl.dot(xt.to(tl.float32), wt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, wt, acc, input_precision=PRECISION)  # [BM, BK] @ [BK, BN]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def tile_schedule(expert_offsets: Tensor, num_rows: int, block_m: int) -> tuple[Tensor, Tensor]:
    """(tile_expert int32, tile_row int64), each of length cdiv(M, BLOCK_M) + E (an upper bound).

    Expert e with c rows owns cdiv(c, BLOCK_M) consecutive tiles starting at its first row; unused
    tiles have expert -1. Built with device ops only, so it needs no device-to-host read.
    offsets [0, 3, 3, 20], BLOCK_M 16 -> tiles (0, row 0), (2, row 3), (2, row 19), then (-1, ...).
    """
    num_experts = expert_offsets.numel() - 1
    max_tiles = triton.cdiv(max(num_rows, 1), block_m) + num_experts
    counts = expert_offsets[1:] - expert_offsets[:-1]
    tiles_per_expert = torch.div(counts + block_m - 1, block_m, rounding_mode="floor")
    tile_end = torch.cumsum(tiles_per_expert, 0)  # [E]: one past each expert's last tile
    tile_ids = torch.arange(max_tiles, device=expert_offsets.device, dtype=torch.int64)
    expert = torch.searchsorted(tile_end, tile_ids, right=True)  # first expert whose tiles end after t
    used = expert < num_experts
    safe = expert.clamp(max=num_experts - 1)
    first_tile = tile_end[safe] - tiles_per_expert[safe]
    row = expert_offsets[safe] + (tile_ids - first_tile) * block_m
    return torch.where(used, safe, -1).to(torch.int32), row


def _blocks(n: int, k: int, on_cuda: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) from the weight's shape and the device only (never from M)."""

    def pow2(v: int, hi: int) -> int:
        return max(16, min(hi, triton.next_power_of_2(max(v, 1))))

    if on_cuda:
        return 64, pow2(n, 128), pow2(k, 64)
    return 16, pow2(n, 64), pow2(k, 128)  # the interpreter: fewer, larger programs run faster


def grouped_gemm(
    x: Tensor, w: Tensor, expert_offsets: Tensor, *, blocks: tuple[int, int, int] | None = None
) -> Tensor:
    """x [M, K] sorted by expert, w [E, N, K], expert_offsets [E + 1] int64 -> y [M, N] in x's dtype.

    `blocks` (BLOCK_M, BLOCK_N, BLOCK_K), each a power of two >= 16, overrides the default for tests.
    """
    check_grouped(x, w, expert_offsets)
    if not x.is_cuda and not triton.knobs.runtime.interpret:
        raise ValueError(
            f"the Triton grouped GEMM needs CUDA tensors (x is on {x.device}) or TRITON_INTERPRET=1"
        )
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if not capturing:
        check_offsets(expert_offsets, x.shape[0])
    num_rows, (_, n, k) = x.shape[0], w.shape
    y = x.new_empty(num_rows, n)
    if num_rows == 0 or n == 0:
        return y
    block_m, block_n, block_k = blocks or _blocks(n, k, x.is_cuda)
    if min(block_m, block_n, block_k) < 16:
        raise ValueError(f"blocks {(block_m, block_n, block_k)} must each be >= 16 (tl.dot's smallest tile)")
    tile_expert, tile_row = tile_schedule(expert_offsets, num_rows, block_m)
    grid = (tile_expert.numel(), triton.cdiv(n, block_n))
    _grouped_kernel[grid](
        x, *x.stride(), w, *w.stride(), y, *y.stride(), expert_offsets, tile_expert, tile_row, n, k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST=not x.is_cuda and x.dtype == torch.bfloat16,
    )  # fmt: skip
    return y
