"""Host side of the Triton paged-attention kernels (triton_kernels.py): tile sizes (every dot axis >= 16),
precision per dtype, the flash-decoding split count, grids, and the launches of decode (+ split merge)
and prefill. Arguments arrive already checked by api.py; nothing here reads a device value."""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from kernels.attention.triton_kernels import LOG2E, _decode_kernel, _merge_splits_kernel, _prefill_kernel

__all__ = [
    "LOG2E",
    "_decode_kernel",
    "_merge_splits_kernel",
    "_prefill_kernel",
    "decode",
    "default_num_splits",
    "prefill",
]


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast(t: Tensor) -> bool:
    """The CPU interpreter's tl.dot reads bf16 as raw integers and keeps fp16 products in fp16."""
    return not t.is_cuda and t.dtype != torch.float32


def _score_scales(scale: float, softcap: float | None) -> tuple[float, float]:
    """(qk_scale, cap_log2) for the kernels' _scores: base-2 scores, capped when softcap is set."""
    if softcap is None:
        return scale * LOG2E, 0.0
    return scale / softcap, softcap * LOG2E


def _pow2_at_least(n: int, lo: int) -> int:
    return max(lo, triton.next_power_of_2(max(n, 1)))


def default_num_splits(
    num_rows: int, num_kv_heads: int, device: torch.device, max_seq_len: int | None
) -> int:
    """Flash-decoding splits on a GPU: enough programs for ~2 waves over the SMs, each split >= 256 keys
    when the longest context is known. A power of two, depending only on the batch shape (and the hint),
    so a CUDA graph captured per batch size stays valid for any lengths. 1 under the interpreter."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = max(1, num_rows * num_kv_heads)
    splits = triton.next_power_of_2(max(1, -(-2 * sms // programs)))
    if max_seq_len is not None:
        splits = min(splits, triton.next_power_of_2(max(1, -(-max_seq_len // 256))))
    return max(1, min(splits, 16))


def decode(
    q: Tensor,
    kv_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    out: Tensor,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    rows: Tensor | None,
    num_splits: int,
    block_n: int | None = None,
) -> None:
    """Launch the decode kernel (and the split merge when num_splits > 1); arguments already checked."""
    num_rows = seq_lens.shape[0]
    if num_rows == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    block_d = _pow2_at_least(head_dim, 16)
    if block_n is None:
        block_n = 64 if q.is_cuda else 32
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    common = dict(
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=_pow2_at_least(group, 16),
        BLOCK_N=block_n, BLOCK_D=block_d, NUM_SPLITS=num_splits, HAS_ROWS=rows is not None,
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None, PRECISION=_precision(q.dtype),
        UPCAST=_upcast(q),
    )  # fmt: skip
    rows_arg = rows if rows is not None else seq_lens  # never read without HAS_ROWS
    if num_splits == 1:
        part_o = part_lse = torch.empty(1, dtype=torch.float32, device=q.device)  # never read
        part_strides = (0, 0, 0)
    else:
        part_lse = torch.empty(num_rows, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_o = torch.empty(num_rows, num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
        part_strides = part_lse.stride()  # part_o is indexed as part_lse's offset * BLOCK_D + d
    _decode_kernel[(num_rows, num_kv_heads, num_splits)](
        q, *q.stride(), k_cache, v_cache, *k_cache.stride(), block_tables, *block_tables.stride(),
        seq_lens, rows_arg, out, *out.stride(), part_o, part_lse, *part_strides,
        *_score_scales(scale, softcap), sliding_window or 0, **common,
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(num_rows, num_heads)](
            part_o, part_lse, *part_strides, rows_arg, out, *out.stride(),
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
            BLOCK_S=_pow2_at_least(num_splits, 2), HAS_ROWS=rows is not None,
        )  # fmt: skip


def prefill(
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
    softcap: float | None = None,
    max_query_len: int,
    block_m: int | None = None,
    block_n: int | None = None,
) -> None:
    """Launch the prefill kernel over every chunk; arguments already checked."""
    num_chunks = seq_lens.shape[0]
    if num_chunks == 0 or max_query_len <= 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    group = q.shape[1] // num_kv_heads
    wide = q.is_cuda and q.dtype != torch.float32  # fp32 dots are IEEE FMAs: smaller tiles
    if block_m is None:
        block_m = (128 if max_query_len * group >= 128 else 64) if wide else 32
    block_m = max(block_m, _pow2_at_least(group, 16))  # at least one query per tile
    block_q = block_m // group
    if block_n is None:
        block_n = 64 if wide else 32
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    grid = (triton.cdiv(max_query_len, block_q), num_chunks, num_kv_heads)
    _prefill_kernel[grid](
        q, *q.stride(), k, v, *k.stride(), k_cache, v_cache, *k_cache.stride(),
        block_tables, *block_tables.stride(), query_starts, query_lens, seq_lens, out, *out.stride(),
        *_score_scales(scale, softcap), sliding_window or 0,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q,
        BLOCK_N=block_n, BLOCK_D=_pow2_at_least(head_dim, 16), HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        PRECISION=_precision(q.dtype), UPCAST=_upcast(q), num_warps=8 if block_m >= 128 else 4,
    )  # fmt: skip
