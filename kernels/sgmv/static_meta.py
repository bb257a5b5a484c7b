"""Fixed-capacity SGMV metadata in preallocated buffers: what a captured CUDA graph can replay.

A graph bakes in its launch grids and tensor addresses. `StaticMeta` keeps both fixed: its tensors are
allocated once (capacity rows, `max_segments` segments) and rewritten in place each step, and the
`SgmvMeta` it hands out always says `num_segments = max_segments` and `max_seg_len = capacity`, so the
Triton kernels launch the same grid every time. Segments beyond the step's own have length 0, and their
programs exit before loading anything (`pid_m * BLOCK_M >= seg_len`). A graph captured with one set
of adapters therefore replays correctly with another set, and another number of them (vLLM's
`LoRAKernelMeta` works the same way).

Running example, capacity 6, max_segments 4, token_slots [1, -1, 0, 1, -1, -1]:
  sorted_rows [2, 0, 3, 0, 0, 0], seg_slots [0, 1, 0, 0], seg_starts [0, 1, 3, 3], seg_lens [1, 2, 0, 0].
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.sgmv.meta import SgmvMeta, build_meta


class StaticMeta:
    def __init__(self, capacity: int, max_segments: int, num_slots: int, device: torch.device) -> None:
        if capacity < 1 or max_segments < 1:
            raise ValueError(f"need capacity >= 1 and max_segments >= 1, got {capacity}, {max_segments}")
        self.capacity = capacity
        self.max_segments = max_segments
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.sorted_rows = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.sorted_slots = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.seg_starts = torch.zeros(max_segments, dtype=torch.int32, device=device)
        self.seg_lens = torch.zeros(max_segments, dtype=torch.int32, device=device)
        self.seg_slots = torch.zeros(max_segments, dtype=torch.int32, device=device)

    def update(self, token_slots: Tensor) -> SgmvMeta:
        """Rewrite the buffers for this step's host `token_slots` [<= capacity] (-1 = no adapter);
        the result's tensors are always the same buffers."""
        if token_slots.device.type != "cpu":
            raise ValueError("token_slots must be on the host: the metadata is built there, then copied")
        num_rows = int(token_slots.shape[0])
        if num_rows > self.capacity:
            raise ValueError(f"{num_rows} rows exceed the capacity {self.capacity}")
        padded = torch.full((self.capacity,), -1, dtype=torch.int64, device="cpu")
        padded[:num_rows] = token_slots
        host = build_meta(padded, self.num_slots)
        num_segments, num_active = host.num_segments, host.num_active_rows
        if num_segments > self.max_segments:
            raise ValueError(f"{num_segments} adapters in one step exceed max_segments {self.max_segments}")
        seg_starts = _pad(host.seg_starts_host, self.max_segments, fill=num_active)
        seg_lens = _pad(host.seg_lens_host, self.max_segments, fill=0)
        seg_slots = _pad(host.seg_slots_host, self.max_segments, fill=0)
        sorted_rows = _pad(host.sorted_rows_host, self.capacity, fill=0)
        sorted_slots = _pad(tuple(host.sorted_slots.tolist()), self.capacity, fill=0)
        for buffer, values in (
            (self.sorted_rows, sorted_rows),
            (self.sorted_slots, sorted_slots),
            (self.seg_starts, seg_starts),
            (self.seg_lens, seg_lens),
            (self.seg_slots, seg_slots),
        ):
            _copy_in(buffer, values)
        return SgmvMeta(
            num_tokens=self.capacity,
            num_slots=self.num_slots,
            num_active_rows=num_active,
            num_segments=self.max_segments,
            max_seg_len=self.capacity,
            sorted_rows=self.sorted_rows,
            sorted_slots=self.sorted_slots,
            seg_starts=self.seg_starts,
            seg_lens=self.seg_lens,
            seg_slots=self.seg_slots,
            seg_starts_host=tuple(seg_starts),
            seg_lens_host=tuple(seg_lens),
            seg_slots_host=tuple(seg_slots),
            sorted_rows_host=host.sorted_rows_host,
        )


def _pad(values: tuple[int, ...], size: int, *, fill: int) -> list[int]:
    return list(values) + [fill] * (size - len(values))


def _copy_in(buffer: Tensor, values: list[int]) -> None:
    host = torch.tensor(values, dtype=buffer.dtype, device="cpu")
    if buffer.device.type == "cuda":
        buffer.copy_(host.pin_memory(), non_blocking=True)
    else:
        buffer.copy_(host)
