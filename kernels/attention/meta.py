"""Per-step paged attention metadata: built once on the host, one host-to-device copy, shared by layers.

The engine flattens one step's tokens into rows; some rows are decodes (one new token each), the rest
belong to prefill chunks (runs of rows). `build_paged_meta` packs everything the kernels read (rows,
block tables, lengths) into one int32 host tensor (pinned on CUDA), copies it with non_blocking=True
and keeps the sizes the launches need as host ints, so no layer reads device memory on the host.

Running example, block size 4, rows [d0, p0, p0, p0, d1] (decodes at rows 0 and 4, one chunk at 1..3):
  decode_rows [0, 4], decode_seq_lens [6, 9], decode_block_tables [[7, 2, 0], [3, 5, 8]]  (padded with 0)
  prefill_query_starts [1], prefill_query_lens [3], prefill_seq_lens [5] (2 cached + 3 new),
  prefill_block_tables [[4, 6]], max_query_len 3.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, eq=False)
class PagedAttentionMeta:
    """What `paged_attention` needs for one step (decodes, prefill chunks), on the kernels' device."""

    num_decodes: int  # B (graph padding rows included: seq_len 0)
    num_prefills: int  # N chunks
    max_query_len: int  # longest chunk (0 without chunks): the prefill grid
    max_decode_len: int  # longest decode context: caps the default split count
    sliding_window: int | None
    num_splits: int | None  # decode split-KV; None: per call from B and max_decode_len (not under graphs)
    decode_rows: Tensor | None  # [B] int32 rows of q/out, None: decodes are rows 0..B-1
    decode_seq_lens: Tensor  # [B] int32, the new token included
    decode_block_tables: Tensor  # [B, Wd] int32
    prefill_query_starts: Tensor  # [N] int32
    prefill_query_lens: Tensor  # [N] int32
    prefill_seq_lens: Tensor  # [N] int32, cached prefix + chunk
    prefill_block_tables: Tensor  # [N, Wp] int32
    flat: Tensor  # the one int32 buffer every tensor above is a view of

    def copy_(self, other: PagedAttentionMeta) -> None:
        """Put other's values into this meta's buffers, in one copy (non-blocking from pinned memory):
        how a captured CUDA graph's metadata is refreshed each step. Shapes must match."""
        mine = [None if t is None else tuple(t.shape) for t in self._tensors()]
        theirs = [None if t is None else tuple(t.shape) for t in other._tensors()]
        if (
            mine != theirs
            or self.num_splits != other.num_splits
            or self.sliding_window != other.sliding_window
        ):
            raise ValueError(
                f"metadata layouts differ: {mine} vs {theirs} (num_splits, window must match too)"
            )
        self.flat.copy_(other.flat, non_blocking=True)

    def _tensors(self) -> list[Tensor | None]:
        return [self.decode_rows, self.decode_seq_lens, self.decode_block_tables, self.prefill_query_starts,
                self.prefill_query_lens, self.prefill_seq_lens, self.prefill_block_tables]  # fmt: skip


def _table_rows(tables: Sequence[Sequence[int]], lens: Sequence[int], block_size: int, width: int, pad: int):
    rows = []
    for table, n in zip(tables, lens, strict=True):
        used = list(table[: -(-n // block_size)])
        if len(used) < -(-n // block_size):
            raise ValueError(f"a block table of {len(table)} blocks cannot hold {n} tokens of {block_size}")
        rows.append(used + [pad] * (width - len(used)))
    return rows


def build_paged_meta(
    *,
    block_size: int,
    device: torch.device | str,
    decode_seq_lens: Sequence[int] = (),
    decode_tables: Sequence[Sequence[int]] = (),
    decode_rows: Sequence[int] | None = None,
    prefill_query_starts: Sequence[int] = (),
    prefill_query_lens: Sequence[int] = (),
    prefill_seq_lens: Sequence[int] = (),
    prefill_tables: Sequence[Sequence[int]] = (),
    sliding_window: int | None = None,
    pad_decodes_to: int | None = None,
    decode_table_width: int | None = None,
    num_splits: int | None = None,
    pad_block: int = 0,
    pin_memory: bool | None = None,
) -> PagedAttentionMeta:
    """Host lists -> device metadata, in one copy. Tables are each sequence's block list (only the
    first ceil(seq_len / block_size) entries are kept; the rest of a row is `pad_block`, never read).

    CUDA graphs: pass pad_decodes_to (the captured batch size; extra decodes get seq_len 0 and read
    nothing; rows must then be None, the padding rows being rows B..pad-1 of the padded q), and
    decode_table_width (the captured table width), so every step's tensors keep the captured shapes,
    and num_splits (the captured split count). Then `static.copy_(build_paged_meta(..., device="cpu",
    pin_memory=True))` refreshes the captured metadata with one host-to-device copy.
    pin_memory: build in pinned host memory (default: when device is CUDA).
    """
    device = torch.device(device)
    dec_lens = list(decode_seq_lens)
    num_real = len(dec_lens)
    num_dec = num_real if pad_decodes_to is None else pad_decodes_to
    if num_dec < num_real:
        raise ValueError(f"pad_decodes_to={pad_decodes_to} < {num_real} decodes")
    if pad_decodes_to is not None and decode_rows is not None:
        raise ValueError("pad_decodes_to needs decode_rows=None (padding rows are rows B..pad-1 of q)")
    if pad_decodes_to is not None and num_splits is None:
        raise ValueError("pad_decodes_to needs num_splits: a captured graph fixes the split count")
    need = max([1, *(-(-n // block_size) for n in dec_lens)])
    width_d = need if decode_table_width is None else decode_table_width
    if width_d < need:
        raise ValueError(f"decode_table_width={decode_table_width} < {need} blocks needed")
    dec_tables = _table_rows(decode_tables, dec_lens, block_size, width_d, pad_block)
    dec_tables += [[pad_block] * width_d] * (num_dec - num_real)
    dec_lens += [0] * (num_dec - num_real)
    pre_lens = list(prefill_seq_lens)
    width_p = max([1, *(-(-n // block_size) for n in pre_lens)])
    pre_tables = _table_rows(prefill_tables, pre_lens, block_size, width_p, pad_block)
    num_pre = len(pre_lens)
    if not len(prefill_query_starts) == len(prefill_query_lens) == num_pre:
        raise ValueError("prefill_query_starts, prefill_query_lens and prefill_seq_lens differ in length")
    rows = list(decode_rows) if decode_rows is not None else []
    if decode_rows is not None and len(rows) != num_real:
        raise ValueError(f"{len(rows)} decode_rows for {num_real} decodes")
    # one flat int32 buffer: [rows | dec lens | dec tables | starts | q lens | seq lens | pre tables]
    parts = [rows, dec_lens, [b for t in dec_tables for b in t], list(prefill_query_starts),
             list(prefill_query_lens), pre_lens, [b for t in pre_tables for b in t]]  # fmt: skip
    host = torch.tensor([x for p in parts for x in p], dtype=torch.int32, device="cpu")
    if device.type == "cuda" if pin_memory is None else pin_memory:
        host = host.pin_memory()
    flat = host.to(device, non_blocking=True)
    views, at = [], 0
    for p in parts:
        views.append(flat[at : at + len(p)])
        at += len(p)
    return PagedAttentionMeta(
        num_decodes=num_dec,
        num_prefills=num_pre,
        max_query_len=max([0, *prefill_query_lens]),
        max_decode_len=max([0, *dec_lens]),
        sliding_window=sliding_window,
        num_splits=num_splits,
        decode_rows=views[0] if decode_rows is not None else None,
        decode_seq_lens=views[1],
        decode_block_tables=views[2].view(num_dec, width_d),
        prefill_query_starts=views[3],
        prefill_query_lens=views[4],
        prefill_seq_lens=views[5],
        prefill_block_tables=views[6].view(num_pre, width_p),
        flat=flat,
    )
