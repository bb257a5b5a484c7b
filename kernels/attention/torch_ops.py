"""The PyTorch twin of the Triton paged attention kernels: same arguments, same semantics (api.py).

A per-row (decode) / per-chunk (prefill) loop in fp32 that gathers exactly the keys a row may see,
so, like the kernels, it never touches a stale slot. It reads the lengths and block tables on the host
(one sync per call on CUDA tensors); it exists for CPU runs and as the kernels' executable spec, not
for speed (the engine's CPU path is base_engine/runner/attention.py's bucketed SDPA).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _gather(cache: Tensor, table: Tensor, pos: Tensor, block_size: int) -> Tensor:
    """cache [blocks, bs, KVH, D], positions [L] -> fp32 [L, KVH, D] via one sequence's block table."""
    blocks = table.index_select(0, torch.div(pos, block_size, rounding_mode="floor")).long()
    return cache[blocks, pos % block_size].float()


def _cap(scores: Tensor, softcap: float | None) -> Tensor:
    """softcap * tanh(scores / softcap), or the scores themselves without a cap."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def decode_torch(
    q: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    out: Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    rows: Tensor | None,
) -> None:
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    block_size = kv_cache.shape[2]
    num_heads = q.shape[1]
    lens = seq_lens.tolist()
    out_rows = rows.tolist() if rows is not None else range(len(lens))
    for b, (row, seq_len) in enumerate(zip(out_rows, lens, strict=True)):
        lo = 0 if sliding_window is None else max(0, seq_len - sliding_window)
        if seq_len <= lo:
            out[row] = 0
            continue
        pos = torch.arange(lo, seq_len, device=q.device)
        keys = _gather(kv_cache[0], block_tables[b], pos, block_size)  # [L, KVH, D]
        values = _gather(kv_cache[1], block_tables[b], pos, block_size)
        qf = q[row].float().view(num_kv_heads, num_heads // num_kv_heads, head_dim)
        probs = torch.softmax(_cap(torch.einsum("hgd,lhd->hgl", qf, keys) * scale, softcap), dim=-1)
        out[row] = torch.einsum("hgl,lhd->hgd", probs, values).reshape(num_heads, head_dim).to(out.dtype)


def prefill_torch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    query_starts: Tensor,
    query_lens: Tensor,
    seq_lens: Tensor,
    out: Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    block_size = kv_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    chunks = zip(query_starts.tolist(), query_lens.tolist(), seq_lens.tolist(), strict=True)
    for n, (start, q_len, seq_len) in enumerate(chunks):
        if q_len <= 0:
            continue
        ctx = seq_len - q_len
        rows = slice(start, start + q_len)
        # keys the chunk's first query may see onwards: [lo, ctx) cached, then the chunk's own
        lo = 0 if sliding_window is None else max(0, ctx - sliding_window + 1)
        pos = torch.arange(lo, ctx, device=q.device)
        keys = torch.cat([_gather(kv_cache[0], block_tables[n], pos, block_size), k[rows].float()])
        values = torch.cat([_gather(kv_cache[1], block_tables[n], pos, block_size), v[rows].float()])
        q_pos = torch.arange(ctx, seq_len, device=q.device).unsqueeze(1)  # [n, 1]
        k_pos = torch.arange(lo, seq_len, device=q.device).unsqueeze(0)  # [1, L]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= (q_pos - k_pos) < sliding_window
        qf = q[rows].float().view(q_len, num_kv_heads, group, head_dim)
        scores = _cap(torch.einsum("qhgd,lhd->hgql", qf, keys) * scale, softcap)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        res = torch.einsum("hgql,lhd->qhgd", probs, values)
        out[rows] = res.reshape(q_len, q.shape[1], head_dim).to(out.dtype)
