"""Public paged attention ops: `paged_decode_attention`, `paged_prefill_attention`, and `paged_attention`
(both, for one step's rows, from a `PagedAttentionMeta`).

Each op checks its arguments once (shapes, dtypes, devices; never device values, so no host sync) and
dispatches to the Triton kernels (`triton_ops`) or their PyTorch twin (`torch_ops`).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from kernels.attention import torch_ops
from kernels.attention.checks import (
    check_block_tables,
    check_cache,
    check_heads,
    check_index,
    check_lengths,
    check_out,
    check_same,
    check_scalars,
)
from kernels.attention.meta import PagedAttentionMeta

Backend = Literal["auto", "triton", "torch"]
BACKENDS = ("auto", "triton", "torch")


def _triton_interprets() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1, read by Triton itself)."""
    import triton.knobs

    return bool(triton.knobs.runtime.interpret)


def resolve_backend(backend: str, q: Tensor) -> str:
    """ "auto": Triton for CUDA tensors, the twin otherwise; "triton" on CPU only under the interpreter."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}, expected one of {BACKENDS}")
    if backend == "auto":
        return "triton" if q.is_cuda else "torch"
    if backend == "triton" and not q.is_cuda and not _triton_interprets():
        raise ValueError(f"backend='triton' needs CUDA tensors (q is on {q.device}) or TRITON_INTERPRET=1")
    return backend


def paged_decode_attention(
    q: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    rows: Tensor | None = None,
    out: Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    backend: Backend = "auto",
) -> Tensor:
    """One new query token per sequence against its cached keys, read through its block table.

    Semantics:
        paged_decode_attention(q, kv_cache, block_tables, seq_lens, *, scale, sliding_window=None,
                               softcap=None, rows=None, out=None, num_splits=None, max_seq_len=None,
                               backend="auto") -> out
          kv_cache:     [2, num_blocks, bs, KVH, D]   K = kv_cache[0], V = kv_cache[1] (one layer)
          block_tables: [B, max_blocks] int32/int64   block j of sequence b is block_tables[b, j]
          seq_lens:     [B] int                       tokens of sequence b in the cache, the new one included
          rows:         [B] int or None               sequence b's query/output row (None: row b)
          q:            [B, H, D] (rows None) or [T, H, D];  out: like q (default: a new tensor like q)
          H = G * KVH (GQA); head h reads KV head h // G.
          for b with n = seq_lens[b], lo = max(0, n - sliding_window) (0 without a window), r = rows[b]:
              key position j in [lo, n) lives at slot (block_tables[b, j // bs], j % bs)
              out[r, h] = softmax_j(cap(scale * q[r, h] . K[j, h // G])) @ V[j, h // G]   (fp32 accumulation)
              cap(s) = softcap * tanh(s / softcap) (Gemma 2's attention soft-cap), cap(s) = s without one
          a row with n == 0 reads nothing and gets zeros (e.g. CUDA-graph padding rows);
          out rows not in `rows` are left untouched.
          Nothing outside those keys is read: other slots, unused block-table entries (beyond
          ceil(n / bs), or before lo's block) and padding may hold any bits (NaN/Inf) without effect.

    num_splits: flash-decoding splits of each row's keys (default: from the batch shape on CUDA, 1
    elsewhere); max_seq_len: an optional host-side bound on seq_lens that caps the default splits.
    The Triton path reads no device value on the host (graph-capturable for a fixed B and num_splits).
    backend: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch" (the twin), "auto".
    Raises ValueError on any shape/dtype/device mismatch.
    """
    cache = check_cache(kv_cache)
    num_seqs = check_lengths("seq_lens", seq_lens)
    check_heads("q", q, None if rows is not None else num_seqs, cache)
    if rows is not None:
        check_index("rows", rows, num_seqs)
    check_block_tables(block_tables, num_seqs)
    check_same({"kv_cache": kv_cache}, q, "q", dtype=True)
    check_same({"block_tables": block_tables, "seq_lens": seq_lens}, q, "q", dtype=False)
    if rows is not None:
        check_same({"rows": rows}, q, "q", dtype=False)
    check_scalars(scale, sliding_window, softcap)
    check_out(out, q, q.shape[0])
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits={num_splits!r}, expected None or an int >= 1")
    if out is None:
        out = torch.empty_like(q)
    if resolve_backend(backend, q) == "torch":
        torch_ops.decode_torch(
            q, kv_cache, block_tables, seq_lens, out, scale=scale, sliding_window=sliding_window,
            softcap=softcap, rows=rows,
        )  # fmt: skip
        return out
    from kernels.attention import triton_ops  # imported on first use: TRITON_INTERPRET is read at import

    if num_splits is None:
        num_splits = triton_ops.default_num_splits(num_seqs, cache.num_kv_heads, q.device, max_seq_len)
    triton_ops.decode(
        q, kv_cache, block_tables, seq_lens, out,
        scale=scale, sliding_window=sliding_window, softcap=softcap, rows=rows, num_splits=num_splits,
    )  # fmt: skip
    return out


def paged_prefill_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    query_starts: Tensor,
    query_lens: Tensor,
    seq_lens: Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    max_query_len: int | None = None,
    out: Tensor | None = None,
    backend: Backend = "auto",
) -> Tensor:
    """Prefill chunks: each chunk's queries attend to its cached prefix (through the block table) and,
    causally, to the chunk's own keys (from k/v), in one launch for all chunks.

    Semantics:
        paged_prefill_attention(q, k, v, kv_cache, block_tables, query_starts, query_lens, seq_lens,
            *, scale, sliding_window=None, softcap=None, max_query_len=None, out=None, backend="auto") -> out
          q: [T, H, D]; k, v: [T, KVH, D] (this step's keys/values); out: like q (default: new)
          kv_cache: [2, num_blocks, bs, KVH, D]; block_tables: [N, max_blocks] int
          chunk n: rows [s, s + m) of q/k/v/out with s = query_starts[n], m = query_lens[n];
                   c = seq_lens[n] - m tokens already cached before it (its prefix)
          query i of chunk n sits at position p = c + i and sees key positions j with
              j <= p  and  p - j < sliding_window (no bound without a window)
          key j < c:  K/V at slot (block_tables[n, j // bs], j % bs) of kv_cache
          key j >= c: k/v row s + (j - c)
          out[s + i, h] = softmax_j(cap(scale * q[s + i, h] . K[j, h // G])) @ V[j, h // G]
          (fp32 accumulation; cap as in paged_decode_attention)
          rows of q/out outside every chunk are left untouched; a chunk with m == 0 does nothing.
          Read: only cached keys some query of the chunk sees (j in [max(0, c - W + 1), c)); the
          cache's slots at positions >= c, unused block-table entries and everything else may hold
          any bits (NaN/Inf) without effect.

    max_query_len: host-side max of query_lens, sizes the grid (None: read from the device, one sync).
    backend: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch" (the twin), "auto".
    Raises ValueError on any shape/dtype/device mismatch.
    """
    cache = check_cache(kv_cache)
    check_heads("q", q, None, cache)
    check_heads("k", k, q.shape[0], cache, kv=True)
    check_heads("v", v, q.shape[0], cache, kv=True)
    num_chunks = check_lengths("seq_lens", seq_lens)
    check_index("query_starts", query_starts, num_chunks)
    check_index("query_lens", query_lens, num_chunks)
    check_block_tables(block_tables, num_chunks)
    check_same({"k": k, "v": v, "kv_cache": kv_cache}, q, "q", dtype=True)
    index = {"block_tables": block_tables, "query_starts": query_starts, "query_lens": query_lens}
    check_same(index | {"seq_lens": seq_lens}, q, "q", dtype=False)
    check_scalars(scale, sliding_window, softcap)
    check_out(out, q, q.shape[0])
    if max_query_len is not None and (not isinstance(max_query_len, int) or max_query_len < 0):
        raise ValueError(f"max_query_len={max_query_len!r}, expected None or an int >= 0")
    if out is None:
        out = torch.empty_like(q)
    if resolve_backend(backend, q) == "torch":
        torch_ops.prefill_torch(
            q, k, v, kv_cache, block_tables, query_starts, query_lens, seq_lens, out,
            scale=scale, sliding_window=sliding_window, softcap=softcap,
        )  # fmt: skip
        return out
    from kernels.attention import triton_ops

    if max_query_len is None:
        max_query_len = int(query_lens.max().item()) if num_chunks else 0
    triton_ops.prefill(
        q, k, v, kv_cache, block_tables, query_starts, query_lens, seq_lens, out,
        scale=scale, sliding_window=sliding_window, softcap=softcap, max_query_len=max_query_len,
    )  # fmt: skip
    return out


def paged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: Tensor,
    meta: PagedAttentionMeta,
    *,
    scale: float,
    softcap: float | None = None,
    out: Tensor | None = None,
    backend: Backend = "auto",
) -> Tensor:
    """One layer's attention for a whole step: the decodes, then the prefill chunks, into one out.

    Semantics:
        paged_attention(q, k, v, kv_cache, meta, *, scale, softcap=None, out=None, backend="auto") -> out
          q: [T, H, D]; k, v: [T, KVH, D] (this step's, already written to kv_cache for decodes);
          meta from build_paged_meta (once per step, every layer); out: like q (default: new)
          = paged_decode_attention over meta's decodes (rows meta.decode_rows, or 0..B-1)
            then paged_prefill_attention over meta's chunks, both with meta.sliding_window and softcap;
          rows in neither are left untouched. Reads no device value on the host.
    """
    if not isinstance(meta, PagedAttentionMeta):
        raise ValueError(f"meta is {type(meta).__name__}, expected PagedAttentionMeta (build_paged_meta)")
    if out is None:
        out = torch.empty_like(q)
    if meta.num_decodes:
        paged_decode_attention(
            q, kv_cache, meta.decode_block_tables, meta.decode_seq_lens, scale=scale,
            sliding_window=meta.sliding_window, softcap=softcap, rows=meta.decode_rows, out=out,
            num_splits=meta.num_splits,
            max_seq_len=meta.max_decode_len, backend=backend,
        )  # fmt: skip
    if meta.num_prefills:
        paged_prefill_attention(
            q, k, v, kv_cache, meta.prefill_block_tables, meta.prefill_query_starts, meta.prefill_query_lens,
            meta.prefill_seq_lens, scale=scale, sliding_window=meta.sliding_window, softcap=softcap,
            max_query_len=meta.max_query_len, out=out, backend=backend,
        )  # fmt: skip
    return out
