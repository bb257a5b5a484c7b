"""Paged attention: the bucketed PyTorch path (fastest on CPU), or `kernels.attention` (Triton on CUDA).

K/V live in a block pool `[2, num_blocks, block_size, kv_heads, head_dim]` per layer; each sequence
reaches its tokens through its block table (PagedAttention, SOSP 2023). One step's tokens are flattened:
decodes (one new token each) are attended in a few length buckets, each one padded batch padded only to
its own longest sequence (one batch padded to the longest of all would roughly double the keys read
when contexts spread); prefill chunks one sequence at a time, since their query lengths differ (a
padded batch would multiply work by max/mean chunk length). This module holds the step metadata and
the attention calls; the decode buckets are planned in `base_engine/runner/decode_buckets.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from base_engine.runner.decode_buckets import (
    DecodeBucket,
)
from kernels.attention import PagedAttentionMeta, paged_attention

# The bucket planner moved to base_engine/runner/decode_buckets.py; its names stay importable from here.


@dataclass(slots=True)
class PrefillChunk:
    token_start: int  # first row of this chunk in the flattened batch
    num_tokens: int  # query length
    context_len: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor  # [num_blocks_of_seq] int64
    mask: torch.Tensor | None  # [num_tokens, context_len + num_tokens] bool, None = plain causal


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64 flat cache slot (block * block_size + offset) per new token
    decode_buckets: list[DecodeBucket]  # single-token decodes grouped by length (plan_decode_buckets)
    prefills: list[PrefillChunk]
    paged: PagedAttentionMeta | None = None  # set: kernels.attention reads the block tables directly
    # A deterministic step (base_engine/invariant.py): batch-invariant GEMMs, and every token (prefill or
    # decode) attended alone in `decode_buckets` (build_token_buckets), so `prefills` is empty.
    invariant: bool = False
    # A model mixing sliding-window and global layers (Gemma): this metadata is the global layers', and
    # `sliding` the windowed layers' (same rows and blocks, their own window). None: every layer's.
    sliding: AttentionMetadata | None = None


def paged_with_window(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """`meta` (paged) for layers with sliding window `window`: the same device tensors (a CUDA graph's
    refreshed buffers included), only the window differs."""
    assert meta.paged is not None
    return dataclasses.replace(meta, paged=dataclasses.replace(meta.paged, sliding_window=window))


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V: kv_cache [2, blocks, bs, kvh, d]; k, v [T, kvh, d]."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def attend(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D] (this step's keys, already written to the cache)
    v: torch.Tensor,  # [T, KVH, D]
    kv_cache: torch.Tensor,  # [2, blocks, bs, KVH, D]
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap) before the softmax
) -> torch.Tensor:  # [T, H, D]
    if meta.paged is not None:
        return paged_attention(q, k, v, kv_cache, meta.paged, scale=scale, softcap=softcap)
    out = torch.empty_like(q)
    for bucket in meta.decode_buckets:
        _decode(q, kv_cache, bucket, scale, softcap, out)
    for chunk in meta.prefills:
        _prefill(q, k, v, kv_cache, chunk, scale, softcap, out)
    return out


def _sdpa(
    q: torch.Tensor,  # [..., H, Lq, D]
    k: torch.Tensor,  # [..., KVH, Lk, D]
    v: torch.Tensor,
    *,
    scale: float,
    softcap: float | None,
    mask: torch.Tensor | None = None,  # bool (True = may attend) or additive, broadcast to the scores
    is_causal: bool = False,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """SDPA, or with a soft-cap the same in explicit ops (SDPA has no hook between QK and softmax), in
    transformers' eager order: scores * scale, cap, + mask, softmax in fp32, back to q's dtype, @ V."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    # Contiguous operands: each row is then its own GEMM of one shape, whose bits do not depend on the
    # batch (a deterministic step, test_batch_invariance). Strided or broadcast keys (gathered blocks,
    # shared_keys) take matmul paths that fold rows together and round differently with their number.
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [..., H, Lq, Lk]
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        num_q, num_k = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(num_q, num_k, dtype=torch.bool, device=q.device).tril(num_k - num_q)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    bucket: DecodeBucket,
    scale: float,
    softcap: float | None,
    out: torch.Tensor,
) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[3]
    n = bucket.rows.shape[0]
    run = None if bucket.first_row is None else slice(bucket.first_row, bucket.first_row + n)
    qd = q.index_select(0, bucket.rows) if run is None else q[run]
    # Queries of one KV head's group act as a G-long query "sequence": [n, KVH, G, D]
    qd = qd.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
    # Gather each row's blocks: [n * num_blocks, bs, KVH, D] -> [n, KVH, L, D]
    flat = bucket.block_tables.view(-1)
    copies = 1 if bucket.shared_keys else n  # shared: one gathered copy, broadcast to every row
    # K and V in one gather (one parallel region, not two: each region's join waits on every thread,
    # which on shared cores means a descheduled one): the pool as [2 * blocks, ...], V's blocks offset.
    num_blocks = kv_cache.shape[1]
    pool = kv_cache.view(2 * num_blocks, *kv_cache.shape[2:])
    both = pool.index_select(0, torch.cat([flat, flat + num_blocks]))
    keys, values = (half.view(copies, -1, num_kv_heads, head_dim).transpose(1, 2) for half in both.chunk(2))
    if bucket.shared_keys:
        keys, values = keys.expand(n, -1, -1, -1), values.expand(n, -1, -1, -1)
    res = _sdpa(qd, keys, values, mask=bucket.mask, scale=scale, softcap=softcap)
    res = res.reshape(n, num_heads, head_dim)  # [n, H, D]
    if run is None:
        out.index_copy_(0, bucket.rows, res)
    else:
        out[run] = res


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    chunk: PrefillChunk,
    scale: float,
    softcap: float | None,
    out: torch.Tensor,
) -> None:
    rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
    qc = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if chunk.context_len == 0:
        # First chunk of a sequence: its keys are exactly this step's, no need to read the cache.
        kc, vc = k[rows], v[rows]
    else:
        num_kv = chunk.context_len + chunk.num_tokens
        kc = kv_cache[0][chunk.block_table].flatten(0, 1)[:num_kv]  # [L, KVH, D]
        vc = kv_cache[1][chunk.block_table].flatten(0, 1)[:num_kv]
    kc = kc.transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
    vc = vc.transpose(0, 1).unsqueeze(0)
    causal = chunk.mask is None
    res = _sdpa(qc, kc, vc, mask=chunk.mask, is_causal=causal, scale=scale, softcap=softcap, enable_gqa=True)
    out[rows] = res.squeeze(0).transpose(0, 1)


def chunk_mask(context_len: int, num_tokens: int, sliding_window: int | None) -> torch.Tensor | None:
    """Bool mask [n, context_len + n]: query i (position context_len + i) sees key j iff j <= its
    position and, with a sliding window W, position - j < W. None when plain causal SDPA suffices."""
    if context_len == 0 and sliding_window is None:
        return None
    q_pos = torch.arange(context_len, context_len + num_tokens, device="cpu").unsqueeze(1)
    k_pos = torch.arange(context_len + num_tokens, device="cpu").unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= (q_pos - k_pos) < sliding_window
    return mask
