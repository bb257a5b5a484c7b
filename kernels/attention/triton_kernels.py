"""Triton paged attention: decode (split-KV, flash-decoding) and prefill over cached prefix blocks.

Layout (PagedAttention, Kwon et al. SOSP 2023; FlashAttention-2's online softmax; flash-decoding's
split-KV; vLLM's Triton unified attention for the per-key block lookup):
  * K/V are read in place from the block pool `kv_cache[0|1]: [num_blocks, block_size, KVH, D]`: each
    tile of BLOCK_N keys looks up `block_tables[row, pos // block_size]` per key, so no gather copy is
    made and a tile need not align with blocks;
  * GQA: one program serves all G = H / KVH query heads of one KV head, so each K/V tile is loaded once
    for the group (decode: G heads padded to BLOCK_G >= 16 rows; prefill: BLOCK_M rows = queries x G);
  * fp32 accumulation, online softmax in base 2 (scale * log2(e) folded into the scores); fp16/bf16
    tiles go to tensor-core dots, P is rounded to V's dtype for the PV dot (as FlashAttention does);
    fp32 tiles use IEEE dots (TF32 would miss the fp32 tolerance); every dot axis is >= 16;
  * safety: a key is loaded only when some query of the tile may see it; every other slot
    (beyond seq_len, before a sliding window, unused block-table entries, padded rows) is masked at the
    load (`other=0`): its block-table entry is not even read, so stale bits (NaN/Inf) never reach an
    output. Masked scores are -inf and their P is exactly 0 against V loaded as 0;
  * soft-capping (Gemma 2): scores become cap * tanh(s / cap) before the softmax, tanh built from
    exp2 (which the interpreter and every GPU backend have); qk_scale is then scale / cap and
    cap_log2 = cap * log2(e);
  * the running max starts at a finite -1e30, so a row (or split) that sees no key keeps l = 0 and
    writes zeros instead of NaN (rows with seq_len 0, e.g. CUDA-graph padding rows).
Decode with NUM_SPLITS > 1 writes per-split (o, log2-sum-exp) to fp32 buffers and a second kernel merges
them; the grid depends only on (B, KVH, NUM_SPLITS), never on the lengths, so it can be graph-captured.

This module holds the @triton.jit kernels only; triton_ops.py picks tile sizes and grids and launches
them. Import it lazily (through triton_ops): TRITON_INTERPRET is read when the kernels are decorated.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b in fp32. UPCAST: the CPU interpreter's dot reads fp16/bf16 badly, so widen first."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _scores(qk, qk_scale, cap_log2, HAS_SOFTCAP: tl.constexpr):
    """Raw dots -> base-2 scores: qk * scale * log2(e), or capped: cap * log2(e) * tanh(qk * scale / cap)."""
    s = qk * qk_scale
    if HAS_SOFTCAP:
        # tanh|x| = (1 - e^(-2|x|)) / (1 + e^(-2|x|)): no overflow for any x; -2 * log2(e) below
        t = tl.exp2(tl.abs(s) * -2.8853900817779268)
        th = (1.0 - t) / (1.0 + t)
        s = tl.where(s < 0, -th, th) * cap_log2
    return s


@triton.jit
def _softmax_step(acc, l_i, m_i, s, allowed, v, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One online-softmax update with scores s (already scaled to base 2) and the V tile v."""
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # exactly 0 where not allowed
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return acc, l_i, m_new


@triton.jit
def _load_k_tile(
    k_cache_ptr, bt_row, pos, valid, kvh, offs_d, d_mask,
    stride_btn, stride_cb, stride_cs, stride_ch, stride_cd, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """The K tile [BLOCK_N, BLOCK_D] of keys `pos` of KV head `kvh` from the block pool, each key's block
    looked up in the table row (a key outside `valid` reads no table entry and loads 0), and the offsets
    and mask that load the V tile (callers load V after the QK dot)."""
    blk = tl.load(bt_row + (pos // BLOCK_SIZE) * stride_btn, mask=valid, other=0).to(tl.int64)
    kv_off = (
        blk[:, None] * stride_cb
        + (pos % BLOCK_SIZE)[:, None] * stride_cs
        + kvh * stride_ch
        + offs_d[None, :] * stride_cd
    )
    kv_mask = valid[:, None] & d_mask[None, :]
    return tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0), kv_off, kv_mask


@triton.jit
def _decode_kernel(
    q_ptr, stride_qt, stride_qh, stride_qd,
    k_cache_ptr, v_cache_ptr, stride_cb, stride_cs, stride_ch, stride_cd,
    bt_ptr, stride_btb, stride_btn,
    seq_lens_ptr, rows_ptr,
    out_ptr, stride_ot, stride_oh, stride_od,
    part_o_ptr, part_lse_ptr, stride_pb, stride_ph, stride_ps,
    qk_scale, cap_log2, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_ROWS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = b.to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    # this split's keys: [k_start, k_end), whole tiles counted from lo
    tiles = tl.cdiv(tl.maximum(seq_len - lo, 0), BLOCK_N)
    per_split = tl.cdiv(tiles, NUM_SPLITS) * BLOCK_N
    k_start = lo + split * per_split
    k_end = tl.minimum(seq_len, k_start + per_split)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    m_i = tl.full((BLOCK_G,), -1.0e30, dtype=tl.float32)  # finite: no NaN when empty
    for start in range(k_start, k_end, BLOCK_N):
        pos = start + offs_n
        valid = pos < k_end  # and >= k_start >= lo
        k, kv_off, kv_mask = _load_k_tile(
            k_cache_ptr, bt_row, pos, valid, kvh, offs_d, d_mask,
            stride_btn, stride_cb, stride_cs, stride_ch, stride_cd, BLOCK_SIZE,
        )  # fmt: skip
        s = _scores(
            _dot(q, tl.trans(k), PRECISION, UPCAST), qk_scale, cap_log2, HAS_SOFTCAP
        )  # [BLOCK_G, BLOCK_N]
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, valid[None, :], v, PRECISION, UPCAST)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = b.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps  # [BLOCK_G]
        tl.store(part_o_ptr + part[:, None] * BLOCK_D + offs_d[None, :], o, mask=mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    part_o_ptr, part_lse_ptr, stride_pb, stride_ph, stride_ps,
    rows_ptr, out_ptr, stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_ROWS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b.to(tl.int64)
    if HAS_ROWS:
        row = tl.load(rows_ptr + b).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    part = b.to(tl.int64) * stride_pb + h * stride_ph + offs_s * stride_ps  # [BLOCK_S]
    lse = tl.load(part_lse_ptr + part, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # 0 for empty splits
    o_mask = s_mask[:, None] & d_mask[None, :]  # columns past HEAD_DIM were never written
    o = tl.load(part_o_ptr + part[:, None] * BLOCK_D + offs_d[None, :], mask=o_mask, other=0.0)
    num = tl.sum(w[:, None] * o, 0)
    den = tl.sum(w, 0)
    res = num / tl.where(den > 0, den, 1.0)
    o_ptrs = out_ptr + row * stride_ot + h * stride_oh + offs_d * stride_od
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _prefill_kernel(
    q_ptr, stride_qt, stride_qh, stride_qd,
    k_ptr, v_ptr, stride_kt, stride_kh, stride_kd,
    k_cache_ptr, v_cache_ptr, stride_cb, stride_cs, stride_ch, stride_cd,
    bt_ptr, stride_btb, stride_btn,
    query_starts_ptr, query_lens_ptr, seq_lens_ptr,
    out_ptr, stride_ot, stride_oh, stride_od,
    qk_scale, cap_log2, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    q_tile = tl.program_id(0)
    n = tl.program_id(1)
    kvh = tl.program_id(2)
    q_len = tl.load(query_lens_ptr + n).to(tl.int32)
    if q_tile * BLOCK_Q >= q_len:
        return
    q_start = tl.load(query_starts_ptr + n).to(tl.int64)
    ctx = tl.load(seq_lens_ptr + n).to(tl.int32) - q_len  # tokens cached before this chunk

    # rows of the tile: query q_tile * BLOCK_Q + r // G, head kvh * G + r % G
    offs_m = tl.arange(0, BLOCK_M)
    qi = q_tile * BLOCK_Q + offs_m // GROUP
    row_valid = (offs_m // GROUP < BLOCK_Q) & (qi < q_len)
    heads = kvh * GROUP + offs_m % GROUP
    q_pos = ctx + qi
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr
        + (q_start + qi)[:, None] * stride_qt
        + heads[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    )
    # keys any valid query of the tile sees: [lo, last + 1)
    first = ctx + q_tile * BLOCK_Q
    last = ctx + tl.minimum(q_len, (q_tile + 1) * BLOCK_Q) - 1
    lo = 0
    own_lo = ctx
    if HAS_WINDOW:
        lo = tl.maximum(first - window + 1, 0)
        own_lo = tl.maximum(lo, ctx)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)

    # 1) the cached prefix [lo, ctx), through the block table (always causal-visible: key < ctx <= query)
    bt_row = bt_ptr + n.to(tl.int64) * stride_btb
    for start in range(lo, ctx, BLOCK_N):
        pos = start + offs_n
        valid = pos < ctx
        k, kv_off, kv_mask = _load_k_tile(
            k_cache_ptr, bt_row, pos, valid, kvh, offs_d, d_mask,
            stride_btn, stride_cb, stride_cs, stride_ch, stride_cd, BLOCK_SIZE,
        )  # fmt: skip
        s = _scores(
            _dot(q, tl.trans(k), PRECISION, UPCAST), qk_scale, cap_log2, HAS_SOFTCAP
        )  # [BLOCK_M, BLOCK_N]
        allowed = row_valid[:, None] & valid[None, :]
        if HAS_WINDOW:
            allowed = allowed & (q_pos[:, None] - pos[None, :] < window)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, allowed, v, PRECISION, UPCAST)

    # 2) the chunk's own keys [max(lo, ctx), last + 1), from k/v rows q_start + (pos - ctx); causal
    for start in range(own_lo, last + 1, BLOCK_N):
        pos = start + offs_n
        valid = pos <= last
        kv_off = (q_start + (pos - ctx))[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :] * stride_kd
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        s = _scores(_dot(q, tl.trans(k), PRECISION, UPCAST), qk_scale, cap_log2, HAS_SOFTCAP)
        allowed = row_valid[:, None] & valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (q_pos[:, None] - pos[None, :] < window)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, allowed, v, PRECISION, UPCAST)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = (
        out_ptr
        + (q_start + qi)[:, None] * stride_ot
        + heads[:, None] * stride_oh
        + offs_d[None, :] * stride_od
    )
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])
