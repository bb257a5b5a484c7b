"""Per-step batch metadata for SGMV: rows sorted by adapter slot, cut into segments.

Follows Punica's segment indptr `s` (Chen et al., "Punica: Multi-Tenant LoRA Serving", MLSys 2024)
and vLLM's `LoRAKernelMeta` (`token_indices_sorted_by_lora_ids`, `lora_token_start_loc`), except that
rows with no adapter (-1) are dropped from the sorted order instead of forming a skipped group.

The engine builds one `SgmvMeta` per step, from the step's `token_slots`, and passes it to every
LoRA layer: `token_slots` is examined (and bounds-checked) here once, and the host-side ints below
let the kernels size their launch grids without reading device memory again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


@dataclass(frozen=True, eq=False)
class SgmvMeta:
    """Sorted row order and segments of one batch.

    Running example, token_slots [1, -1, 0, 1, 1, 0], num_slots 3:
      sorted_rows [2, 5, 0, 3, 4], sorted_slots [0, 0, 1, 1, 1],
      seg_slots [0, 1], seg_starts [0, 2], seg_lens [2, 3], num_segments 2, max_seg_len 3.
    Segment g covers sorted positions seg_starts[g] : seg_starts[g] + seg_lens[g], all of slot seg_slots[g].
    """

    num_tokens: int  # T, rows of x and y
    num_slots: int  # N, adapter slots of the weight stacks
    num_active_rows: int  # M, rows with slot >= 0
    num_segments: int  # G, distinct slots present
    max_seg_len: int  # longest segment (0 when G == 0)
    sorted_rows: Tensor  # [M] int64, row indices grouped by ascending slot, stable within a slot
    sorted_slots: Tensor  # [M] int64, token_slots[sorted_rows]
    seg_starts: Tensor  # [G] int32, offsets into sorted_rows
    seg_lens: Tensor  # [G] int32
    seg_slots: Tensor  # [G] int32
    seg_starts_host: tuple[int, ...]  # the same three, computed once on the host
    seg_lens_host: tuple[int, ...]
    seg_slots_host: tuple[int, ...]
    sorted_rows_host: tuple[int, ...]  # [M], lets the CPU twin address one-row segments without a gather
    # Per-step derived data the twin builds once and every layer reuses (bag plans and indices).
    scratch: dict = field(default_factory=dict, repr=False)
    # Batch-invariant: every row takes one fixed schedule, whatever the batch's composition
    # (the CPU twin's per-row bags), so a row's bits never depend on its neighbours.
    invariant: bool = False

    @property
    def device(self) -> torch.device:
        return self.sorted_rows.device

    def to(self, device: torch.device, *, non_blocking: bool = False) -> SgmvMeta:
        """The same metadata with its tensors on `device` (built on the host once per step, then one
        copy each: no device-to-host read inside the step)."""
        if self.device == torch.device(device):
            return self
        move = {
            name: getattr(self, name).to(device, non_blocking=non_blocking)
            for name in ("sorted_rows", "sorted_slots", "seg_starts", "seg_lens", "seg_slots")
        }
        return replace(self, **move, scratch={})


def _check_token_slots(token_slots: Tensor, num_slots: int) -> None:
    if not isinstance(token_slots, Tensor) or token_slots.dim() != 1:
        shape = tuple(token_slots.shape) if isinstance(token_slots, Tensor) else type(token_slots).__name__
        raise ValueError(f"token_slots must be a 1-D tensor [T], got {shape}")
    if token_slots.dtype not in INT_DTYPES:
        raise ValueError(f"token_slots must have an integer dtype, got {token_slots.dtype}")
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 0:
        raise ValueError(f"num_slots must be an int >= 0, got {num_slots!r}")
    bad = (token_slots < -1) | (token_slots >= num_slots)
    # One device-to-host read per step, here and nowhere else.
    bad_rows = torch.nonzero(bad).flatten().tolist()
    if bad_rows:
        row = bad_rows[0]
        slot = int(token_slots[row])
        raise ValueError(
            f"token_slots[{row}] = {slot}: expected -1 (no adapter) or a slot in [0, {num_slots}) "
            f"({len(bad_rows)} bad row(s))"
        )


def build_meta(token_slots: Tensor, num_slots: int, *, invariant: bool = False) -> SgmvMeta:
    """Sort the batch's rows by adapter slot and cut them into segments (once per step).

    Raises ValueError naming the first row whose slot is < -1 or >= num_slots.
    The tensors of the result live on token_slots' device.
    """
    _check_token_slots(token_slots, num_slots)
    device = token_slots.device
    slots = token_slots.to(torch.int64)
    active_rows = torch.nonzero(slots >= 0).flatten()  # [M]
    active_slots = slots.index_select(0, active_rows)
    # Stable sort keeps rows of one adapter in batch order: slots [1, 0, 1] -> rows [1, 0, 2].
    order = torch.argsort(active_slots, stable=True)
    sorted_rows = active_rows.index_select(0, order)
    sorted_slots = active_slots.index_select(0, order)
    seg_slots, seg_lens = torch.unique_consecutive(sorted_slots, return_counts=True)
    # lens [2, 3] -> starts [0, 2]
    seg_starts = torch.cumsum(seg_lens, 0) - seg_lens
    lens_host = tuple(seg_lens.tolist())
    return SgmvMeta(
        num_tokens=int(token_slots.shape[0]),
        num_slots=num_slots,
        num_active_rows=int(sorted_rows.shape[0]),
        num_segments=len(lens_host),
        max_seg_len=max(lens_host, default=0),
        sorted_rows=sorted_rows,
        sorted_slots=sorted_slots,
        seg_starts=seg_starts.to(device=device, dtype=torch.int32),
        seg_lens=seg_lens.to(device=device, dtype=torch.int32),
        seg_slots=seg_slots.to(device=device, dtype=torch.int32),
        seg_starts_host=tuple(seg_starts.tolist()),
        seg_lens_host=lens_host,
        seg_slots_host=tuple(seg_slots.tolist()),
        sorted_rows_host=tuple(sorted_rows.tolist()),
        invariant=invariant,
    )
