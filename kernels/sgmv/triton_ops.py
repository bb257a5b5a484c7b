"""Triton SGMV shrink/expand kernels (Punica's segmented gather matrix-vector, as vLLM/SGLang write it).

Layout (Chen et al., "Punica", MLSys 2024; vLLM `lora_shrink`/`lora_expand`):
  * one program per (row tile, column tile[, K split]) x slice x segment; the segment gives the slot,
    the sorted row indices are gathered from `meta.sorted_rows`, so rows of one adapter share each
    weight tile they load;
  * up to 3 slices (q/k/v, gate/up) in one launch: the slice is program axis 1 and picks one of
    three weight pointers, so no device array of pointers has to be built per call;
  * fp32 accumulation with `tl.dot` (IEEE for fp32 inputs: TF32 would miss our 5e-5 bound; bf16 tiles
    are upcast only under the CPU interpreter, whose dot reads bf16 as raw integers);
    blocks are >= 16 on every dot axis so the same code compiles for tensor cores;
  * a slot's rank (clamped to R_max) bounds the loops and masks: entries beyond it are never loaded.
Shrink writes scale * x @ A^T into a zeroed fp32 [S, T, R_max] buffer (atomically when split-K);
expand loads y, adds v @ B^T in fp32 (then, for DoRA, multiplies by the slot's per-column output scale
and adds its shift) and stores once, only at the segment's rows and the slice's columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.sgmv.checks import LoraLayout, SlotParams
from kernels.sgmv.meta import SgmvMeta

MAX_SLICES_PER_LAUNCH = 3


@triton.jit
def _pick3(s, p0, p1, p2):
    """Pointer for slice s of the launch (0, 1 or 2)."""
    out = p0
    if s == 1:
        out = p1
    if s == 2:
        out = p2
    return out


@triton.jit
def _pick3_int(s, i0, i1, i2):
    """Int for slice s; arithmetic, since ints equal to 1 may arrive specialized as constants."""
    return i0 * (s == 0).to(tl.int64) + i1 * (s == 1).to(tl.int64) + i2 * (s == 2).to(tl.int64)


@triton.jit
def _shrink_kernel(
    x_ptr, stride_xt, stride_xk,
    a0_ptr, a1_ptr, a2_ptr,
    stride_an, stride_ar, stride_ak,
    v_ptr, stride_vs, stride_vt, stride_vr,
    rows_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr,
    scales_ptr, stride_cs, stride_cn, ranks_ptr, stride_rs, stride_rn,
    slice_base, hidden_in, max_rank,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    local_s = tl.program_id(1)
    seg = tl.program_id(2)
    s = slice_base + local_s
    num_n = tl.cdiv(max_rank, BLOCK_N)
    pid_k = pid % SPLIT_K
    pid_m = (pid // SPLIT_K) // num_n
    pid_n = (pid // SPLIT_K) % num_n
    seg_len = tl.load(seg_lens_ptr + seg)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    rank = tl.minimum(tl.load(ranks_ptr + s * stride_rs + slot * stride_rn), max_rank)
    if pid_m * BLOCK_M >= seg_len or pid_n * BLOCK_N >= rank:
        return
    a_ptr = _pick3(local_s, a0_ptr, a1_ptr, a2_ptr)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    start = tl.load(seg_starts_ptr + seg)
    rows = tl.load(rows_ptr + start + offs_m, mask=m_mask, other=0)  # [BM] int64 original rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < rank
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None] * stride_xt  # [BM, 1]
    a_cols = (
        a_ptr + slot * stride_an + offs_n[None, :] * stride_ar
    )  # [1, BN]: A[slot, n, :] is column n of A^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(hidden_in, BLOCK_K * SPLIT_K)):
        k = (kk * SPLIT_K + pid_k) * BLOCK_K + offs_k  # [BK]
        k_mask = k < hidden_in
        xt = tl.load(x_rows + k[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_cols + k[:, None] * stride_ak, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            acc = tl.dot(xt.to(tl.float32), at.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, at, acc, input_precision=PRECISION)  # [BM, BK] @ [BK, BN]
    acc = acc * tl.load(scales_ptr + s * stride_cs + slot * stride_cn)
    v_ptrs = v_ptr + s * stride_vs + rows[:, None] * stride_vt + offs_n[None, :] * stride_vr
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(v_ptrs, acc, mask=mask)
    else:
        tl.atomic_add(v_ptrs, acc, mask=mask)


@triton.jit
def _expand_kernel(
    y_ptr, stride_yt, stride_yh,
    b0_ptr, b1_ptr, b2_ptr,
    b0_sn, b1_sn, b2_sn, stride_bh, stride_br,
    out0, out1, out2, off0, off1, off2,
    v_ptr, stride_vs, stride_vt, stride_vr,
    rows_ptr, seg_starts_ptr, seg_lens_ptr, seg_slots_ptr,
    ranks_ptr, stride_rs, stride_rn,
    oscale_ptr, oshift_ptr, stride_on, stride_oh,
    slice_base, max_out, max_rank,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SHIFT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    local_s = tl.program_id(1)
    seg = tl.program_id(2)
    s = slice_base + local_s
    num_n = tl.cdiv(max_out, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    n_out = _pick3_int(local_s, out0, out1, out2)
    seg_len = tl.load(seg_lens_ptr + seg)
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    rank = tl.minimum(tl.load(ranks_ptr + s * stride_rs + slot * stride_rn), max_rank)
    if pid_m * BLOCK_M >= seg_len or pid_n * BLOCK_N >= n_out:
        return
    if not HAS_SCALE:  # a constexpr branch: with an output scale a rank-0 row is still rescaled
        if rank == 0:  # nothing to add
            return
    b_ptr = _pick3(local_s, b0_ptr, b1_ptr, b2_ptr)
    sn = _pick3_int(local_s, b0_sn, b1_sn, b2_sn)
    col_off = _pick3_int(local_s, off0, off1, off2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    start = tl.load(seg_starts_ptr + seg)
    rows = tl.load(rows_ptr + start + offs_m, mask=m_mask, other=0)  # [BM] int64
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)
    v_rows = v_ptr + s * stride_vs + rows[:, None] * stride_vt  # [BM, 1]
    b_cols = b_ptr + slot * sn + offs_n[None, :] * stride_bh  # [1, BN]: B[slot, h, :] is column h of B^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(rank, BLOCK_K)):  # stops at the slot's rank: no padded compute
        k = kk * BLOCK_K + offs_k
        k_mask = k < rank
        vt = tl.load(v_rows + k[None, :] * stride_vr, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        bt = tl.load(b_cols + k[:, None] * stride_br, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        # fp16/bf16 weights: round v to the weight dtype for a tensor-core dot (as vLLM does)
        vt = vt.to(bt.dtype)
        if UPCAST:
            acc = tl.dot(vt.to(tl.float32), bt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(vt, bt, acc, input_precision=PRECISION)
    y_ptrs = y_ptr + rows[:, None] * stride_yt + (col_off + offs_n)[None, :] * stride_yh
    mask = m_mask[:, None] & n_mask[None, :]
    y_old = tl.load(y_ptrs, mask=mask, other=0.0)
    out = y_old.to(tl.float32) + acc
    if HAS_SCALE:  # DoRA: the slot's per-column scale (and shift) after the delta, before the one rounding
        o_ptrs = slot * stride_on + (col_off + offs_n) * stride_oh  # [BN]
        out = out * tl.load(oscale_ptr + o_ptrs, mask=n_mask, other=1.0)[None, :]
        if HAS_SHIFT:
            out = out + tl.load(oshift_ptr + o_ptrs, mask=n_mask, other=0.0)[None, :]
    tl.store(y_ptrs, out.to(y_old.dtype), mask=mask)


def _pow2_clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast(t: Tensor) -> bool:
    """The CPU interpreter keeps bf16 as raw uint16 bits and its tl.dot does not convert them."""
    return not t.is_cuda and t.dtype == torch.bfloat16


def _chunks(num_slices: int) -> list[range]:
    """Slices in launches of at most 3: 5 slices -> [0..2], [3..4]."""
    step = MAX_SLICES_PER_LAUNCH
    return [range(i, min(i + step, num_slices)) for i in range(0, num_slices, step)]


def _three(values: Sequence[object], chunk: range) -> list[object]:
    """The chunk's values padded to three by repeating its first (programs of absent slices never run)."""
    picked = [values[i] for i in chunk]
    return picked + [picked[0]] * (MAX_SLICES_PER_LAUNCH - len(picked))


def _shared_inner_strides(weights: Sequence[Tensor], dims: slice) -> list[Tensor]:
    """Slices of one launch share their inner strides, so the kernel can specialize on unit strides.

    Stacks from the adapter cache are contiguous and pass through untouched; anything else is copied.
    """
    first = weights[0].stride()[dims]
    if all(w.stride()[dims] == first for w in weights):
        return list(weights)
    return [w.contiguous() for w in weights]


def _default_split_k(x: Tensor, programs: int, hidden_in: int, block_k: int) -> int:
    """Split K on a GPU when the grid is too small to fill it (decode); never in the interpreter.

    A power of two, so steps with different segment counts share a handful of compiled variants.
    """
    if not x.is_cuda:
        return 1
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    wanted = min(triton.cdiv(hidden_in, block_k), (2 * sms) // max(programs, 1))
    return 1 << max(0, wanted.bit_length() - 1)  # 11 -> 8


def shrink(
    x: Tensor,
    lora_a: Sequence[Tensor],
    meta: SgmvMeta,
    params: SlotParams,
    layout: LoraLayout,
    *,
    split_k: int | None = None,
) -> Tensor:
    """fp32 [S, T, R_max] = scale(s, a) * x[t] @ lora_a[s][a, :r].T; zero elsewhere."""
    v = torch.zeros(layout.num_slices, meta.num_tokens, layout.max_rank, dtype=torch.float32, device=x.device)
    if meta.num_segments == 0:
        return v
    lora_a = _shared_inner_strides(lora_a, slice(0, 3))
    block_m = _pow2_clamp(meta.max_seg_len, 16, 64)
    block_n = _pow2_clamp(layout.max_rank, 16, 64)
    block_k = _pow2_clamp(layout.hidden_in, 16, 128 if x.is_cuda else 256)
    tiles = triton.cdiv(meta.max_seg_len, block_m) * triton.cdiv(layout.max_rank, block_n)
    if split_k is None:
        split_k = _default_split_k(
            x, tiles * layout.num_slices * meta.num_segments, layout.hidden_in, block_k
        )
    for chunk in _chunks(layout.num_slices):
        grid = (tiles * split_k, len(chunk), meta.num_segments)
        _shrink_kernel[grid](
            x, *x.stride(), *_three(lora_a, chunk), *lora_a[0].stride(), v, *v.stride(),
            meta.sorted_rows, meta.seg_starts, meta.seg_lens, meta.seg_slots,
            params.scales, *params.scales.stride(), params.ranks, *params.ranks.stride(),
            chunk.start, layout.hidden_in, layout.max_rank,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, PRECISION=_precision(x.dtype),
            UPCAST=_upcast(x),
        )  # fmt: skip
    return v


def expand(
    y: Tensor,
    v: Tensor,
    lora_b: Sequence[Tensor],
    meta: SgmvMeta,
    params: SlotParams,
    layout: LoraLayout,
    *,
    out_scale: Tensor | None = None,
    out_shift: Tensor | None = None,
) -> None:
    """y[t, off_s:off_s+H_out_s] += v[s, t, :r] @ lora_b[s][a, :, :r].T for rows with a slot; with
    out_scale [N, sum(H_out)] (and out_shift) then y[t] = out_scale[a] * y[t] + out_shift[a]."""
    if meta.num_segments == 0:
        return
    # Absent vectors: y stands in for the pointers (never read: HAS_SCALE / HAS_SHIFT are False).
    oscale = y if out_scale is None else out_scale
    oshift = oscale if out_shift is None else out_shift
    if out_shift is not None and out_shift.stride() != oscale.stride():
        oshift = out_shift.contiguous()
        oscale = oscale.contiguous()
    lora_b = _shared_inner_strides(lora_b, slice(1, 3))
    block_m = _pow2_clamp(meta.max_seg_len, 16, 64)
    block_k = _pow2_clamp(layout.max_rank, 16, 64)
    for chunk in _chunks(layout.num_slices):
        max_out = max(layout.out_sizes[i] for i in chunk)
        block_n = _pow2_clamp(max_out, 16, 128 if y.is_cuda else 64)
        grid = (
            triton.cdiv(meta.max_seg_len, block_m) * triton.cdiv(max_out, block_n),
            len(chunk),
            meta.num_segments,
        )
        _expand_kernel[grid](
            y, *y.stride(), *_three(lora_b, chunk), *_three([w.stride(0) for w in lora_b], chunk),
            *lora_b[0].stride()[1:], *_three(layout.out_sizes, chunk), *_three(layout.out_offsets, chunk),
            v, *v.stride(), meta.sorted_rows, meta.seg_starts, meta.seg_lens, meta.seg_slots,
            params.ranks, *params.ranks.stride(), oscale, oshift, *oscale.stride(),
            chunk.start, max_out, layout.max_rank,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=_precision(y.dtype),
            UPCAST=_upcast(y), HAS_SCALE=out_scale is not None, HAS_SHIFT=out_shift is not None,
        )  # fmt: skip
