"""Where the stacked LoRA weights live in memory: allocation in each device's best layout, and detection.

Every layout is the same `[N, R_max, H_in]` / `[N, H_out_s, R_max]` tensors to the kernels (strided
views); only the storage order differs:
  * CUDA: `lora_a[s]` contiguous per slice (the shrink reads rows along H_in), `lora_b[s]` a transposed
    view of rank-major `[N, R_max, H_out_s]` storage.
  * CPU: the A factors of all slices interleaved in one buffer `[N, H_in, R_max, S]`, so the twin sees
    one embedding table `[N * H_in, R_max * S]` (row = one input feature of one slot, all ranks of all
    slices) and shrinks the whole batch with one `embedding_bag`; `lora_b[s]` rank-major as on CUDA,
    i.e. a table `[N * R_max, H_out_s]` (row = one rank of one slot) for the expand.
`bag_tables` recognises the CPU layout from strides alone, so the twin works on any tensors and takes
its fast path whenever the caller (the engine's slot pool, the benchmark) allocated with `alloc_stacks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor


def alloc_stacks(
    num_slots: int,
    max_rank: int,
    hidden_in: int,
    out_sizes: Sequence[int],
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[list[Tensor], list[Tensor]]:
    """Zeroed (lora_a, lora_b) views for S = len(out_sizes) slices, in `device`'s preferred layout."""
    n, r, s_count = num_slots, max_rank, len(out_sizes)
    if device.type == "cpu":
        fused = torch.zeros(n, hidden_in, r, s_count, dtype=dtype, device=device)
        lora_a = [fused[:, :, :, s].permute(0, 2, 1) for s in range(s_count)]  # [N, R, H_in] views
    else:
        lora_a = [torch.zeros(n, r, hidden_in, dtype=dtype, device=device) for _ in out_sizes]
    # rank-major storage, handed out as [N, H_out, R]: the CPU GEMV / bag streams contiguous H_out rows
    lora_b = [torch.zeros(n, r, h, dtype=dtype, device=device).transpose(1, 2) for h in out_sizes]
    return lora_a, lora_b


class BagTables(NamedTuple):
    """2-D views of the stacks for `embedding_bag` (no copies)."""

    a: Tensor  # [N * H_in, R_max * S]: row (slot, h), column rank * S + slice
    b: list[Tensor]  # per slice [N * R_max, H_out_s]: row (slot, rank)


def _fused_a(lora_a: Sequence[Tensor]) -> Tensor | None:
    first = lora_a[0]
    n, r, h = first.shape
    s_count = len(lora_a)
    want = (h * r * s_count, s_count, r * s_count)
    base = first.storage_offset()
    ptr = first.untyped_storage().data_ptr()
    for s, a in enumerate(lora_a):
        if a.stride() != want or a.storage_offset() != base + s or a.untyped_storage().data_ptr() != ptr:
            return None
    if base + n * h * r * s_count > first.untyped_storage().nbytes() // first.element_size():
        return None
    return torch.as_strided(first, (n * h, r * s_count), (r * s_count, 1), base)


def _rank_major_b(b: Tensor) -> Tensor | None:
    n, h, r = b.shape
    if b.stride() != (r * h, 1, h):
        return None
    return torch.as_strided(b, (n * r, h), (h, 1), b.storage_offset())


def stack_memo(lora_a: Sequence[Tensor], lora_b: Sequence[Tensor]) -> dict | None:
    """A dict kept on lora_a[0] for exactly this pair of stacks (by identity), or None if they are not
    tensor lists. For data derived from the stacks' shapes, strides and storage only (checked layout,
    tables, per-slot views), never from their contents: slot rewrites in place keep it valid."""
    if not _tensor_list(lora_a) or not _tensor_list(lora_b):
        return None
    memo = getattr(lora_a[0], "_sgmv_stack_memo", None)
    if memo is None or not (_same(memo[0], lora_a) and _same(memo[1], lora_b)):
        memo = (tuple(lora_a), tuple(lora_b), {})
        lora_a[0]._sgmv_stack_memo = memo
    return memo[2]


def _tensor_list(weights: object) -> bool:
    return (
        isinstance(weights, (list, tuple))
        and len(weights) > 0
        and all(isinstance(w, Tensor) for w in weights)
    )


def _same(kept: tuple[Tensor, ...], given: Sequence[Tensor]) -> bool:
    return len(kept) == len(given) and all(p is q for p, q in zip(kept, given, strict=True))


def bag_tables(lora_a: Sequence[Tensor], lora_b: Sequence[Tensor]) -> BagTables | None:
    """The embedding tables behind CPU-layout stacks, or None when the stacks are laid out otherwise."""
    memo = stack_memo(lora_a, lora_b)
    if memo is not None and "tables" in memo:
        return memo["tables"]
    tables = _bag_tables(lora_a, lora_b)
    if memo is not None:
        memo["tables"] = tables
    return tables


def _bag_tables(lora_a: Sequence[Tensor], lora_b: Sequence[Tensor]) -> BagTables | None:
    a = _fused_a(lora_a)
    if a is None:
        return None
    b = [_rank_major_b(t) for t in lora_b]
    if any(t is None for t in b):
        return None
    return BagTables(a, [t for t in b if t is not None])
