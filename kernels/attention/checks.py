"""Argument checks for the paged attention ops, once per call at the Python boundary (never in kernels).

Every failure is a ValueError naming the argument, what it got and what was expected. Only shapes,
dtypes and devices are checked: nothing here reads device memory (no host sync), so the values of
block tables, lengths and row indices are the caller's contract (see the Semantics blocks in api.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class CacheShape:
    """What one layer's KV cache `[2, num_blocks, block_size, kv_heads, head_dim]` holds."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int


def _shape(t: object) -> object:
    return tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__


def check_cache(kv_cache: object) -> CacheShape:
    if not isinstance(kv_cache, Tensor) or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache has shape {_shape(kv_cache)}, expected [2, num_blocks, block_size, kv_heads, head_dim]"
        )
    if kv_cache.dtype not in FLOAT_DTYPES:
        raise ValueError(f"kv_cache has dtype {kv_cache.dtype}, expected one of {FLOAT_DTYPES}")
    _, num_blocks, block_size, num_kv_heads, head_dim = (int(n) for n in kv_cache.shape)
    if block_size < 1 or num_kv_heads < 1 or head_dim < 1:
        raise ValueError(
            f"kv_cache has shape {_shape(kv_cache)}: block_size, kv_heads, head_dim must be >= 1"
        )
    return CacheShape(num_blocks, block_size, num_kv_heads, head_dim)


def check_heads(name: str, t: object, rows: int | None, cache: CacheShape, *, kv: bool = False) -> None:
    """t: [rows, H, D] with H a multiple of the cache's KV heads (== them when kv), D the cache's."""
    if not isinstance(t, Tensor) or t.dim() != 3:
        raise ValueError(f"{name} has shape {_shape(t)}, expected a 3-D tensor [tokens, heads, head_dim]")
    num_rows, heads, head_dim = (int(n) for n in t.shape)
    if rows is not None and num_rows != rows:
        raise ValueError(f"{name} has {num_rows} rows, expected {rows}")
    if head_dim != cache.head_dim:
        raise ValueError(f"{name} has head_dim {head_dim}, expected {cache.head_dim} like kv_cache")
    if kv and heads != cache.num_kv_heads:
        raise ValueError(f"{name} has {heads} heads, expected {cache.num_kv_heads} KV heads like kv_cache")
    if not kv and (heads == 0 or heads % cache.num_kv_heads):
        raise ValueError(
            f"{name} has {heads} heads, expected a positive multiple of {cache.num_kv_heads} KV heads"
        )


def check_index(name: str, t: object, length: int) -> None:
    if not isinstance(t, Tensor) or tuple(t.shape) != (length,) or t.dtype not in INT_DTYPES:
        got = f"{_shape(t)} {getattr(t, 'dtype', '')}".strip()
        raise ValueError(f"{name} is {got}, expected an int32/int64 tensor of shape [{length}]")


def check_lengths(name: str, t: object) -> int:
    """A 1-D int32/int64 tensor; returns its length (the number of sequences or chunks)."""
    if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype not in INT_DTYPES:
        got = f"{_shape(t)} {getattr(t, 'dtype', '')}".strip()
        raise ValueError(f"{name} is {got}, expected a 1-D int32/int64 tensor")
    return int(t.shape[0])


def check_block_tables(block_tables: object, rows: int) -> None:
    if (
        not isinstance(block_tables, Tensor)
        or block_tables.dim() != 2
        or block_tables.shape[0] != rows
        or block_tables.dtype not in INT_DTYPES
    ):
        got = f"{_shape(block_tables)} {getattr(block_tables, 'dtype', '')}".strip()
        raise ValueError(f"block_tables is {got}, expected an int32/int64 tensor [{rows}, max_blocks]")
    if block_tables.stride(1) != 1 and block_tables.shape[1] > 1:
        raise ValueError("block_tables must have contiguous rows (stride 1 along the blocks)")


def check_same(tensors: dict[str, Tensor], like: Tensor, like_name: str, *, dtype: bool) -> None:
    for name, t in tensors.items():
        if t.device != like.device:
            raise ValueError(f"{name} is on {t.device}, expected {like.device} like {like_name}")
        if dtype and t.dtype != like.dtype:
            raise ValueError(f"{name} has dtype {t.dtype}, expected {like.dtype} like {like_name}")


def _is_positive(value: object) -> bool:
    return (
        not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
    )


def check_scalars(scale: object, sliding_window: object, softcap: object = None) -> None:
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise ValueError(f"scale={scale!r}, expected a finite float > 0")
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
    ):
        raise ValueError(f"sliding_window={sliding_window!r}, expected None or an int >= 1")
    if softcap is not None and not _is_positive(softcap):
        raise ValueError(f"softcap={softcap!r}, expected None or a finite float > 0")


def check_out(out: Tensor | None, like: Tensor, rows: int | None) -> None:
    """out: q's shape (or [rows_out, H, D] when rows index into it), dtype and device."""
    if out is None:
        return
    if not isinstance(out, Tensor) or out.dim() != 3 or tuple(out.shape[1:]) != tuple(like.shape[1:]):
        raise ValueError(f"out has shape {_shape(out)}, expected [tokens, {like.shape[1]}, {like.shape[2]}]")
    if rows is not None and out.shape[0] != rows:
        raise ValueError(f"out has {out.shape[0]} rows, expected {rows} like q")
    check_same({"out": out}, like, "q", dtype=True)
