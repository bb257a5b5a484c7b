"""Which CPU-layout schedule each segment of a step takes: bags (torch_bag.py) or the fused segment
loop (torch_fused.py), by predicted cost from a short per-(dtype, device) calibration.

The two schedules cost differently (Punica's comparison, section 1.4 of our kernel notes):
  bags          bag_fixed + bag_per_byte * W * (rows in bags)      each row re-reads its adapter's W
                                                                   bytes; one call per slice for all
  segment loop  sum over its segments of
                seg_fixed + seg_per_byte * W + seg_per_row * rows  1 + S small GEMMs reading W once
with W = the bytes of one adapter's A and B for the projection (`weight_bytes`). Under this model a
segment belongs in the bags exactly when it is short: n * (bag_per_byte * W - seg_per_row) <
seg_fixed + seg_per_byte * W, so the pick is a length limit L (`bag_max_rows`), and the bag schedule
runs only when what it saves beats its fixed cost. `calibrate` times both schedules on a few
representative shapes (two projection widths, one- and few-row segments; ~10-40 ms once per dtype and
device per process, at the intra-op threads set by then) and fits the five coefficients by least
squares; tests inject costs with `set_costs` instead of timing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels.sgmv import torch_bag, torch_fused
from kernels.sgmv.checks import LoraLayout, slot_params
from kernels.sgmv.layout import alloc_stacks, bag_tables
from kernels.sgmv.meta import build_meta

# (hidden_in, out_sizes) of the calibration projections: a small one and a q/k/v-like one at
# bench-small's width; rank 16, 16 slots. (segments, rows each) of the calibration batches: decodes,
# short runs, and one 32-row run (where the loop's GEMM reuses the weights: bags would re-read them).
CALIBRATION_SHAPES = ((128, (128,)), (512, (512, 256, 256)))
CALIBRATION_RANK = 16
CALIBRATION_BATCHES = ((4, 1), (16, 1), (2, 6), (1, 32))
REPEATS = 3


@dataclass(frozen=True)
class ScheduleCosts:
    """Seconds (see the module docstring for the model)."""

    bag_fixed: float
    bag_per_byte: float
    seg_fixed: float
    seg_per_byte: float
    seg_per_row: float


_COSTS: dict[tuple[torch.dtype, str], ScheduleCosts] = {}


def weight_bytes(layout: LoraLayout, element_size: int) -> int:
    """Bytes of one adapter's A (all slices) and B for this projection."""
    return element_size * layout.max_rank * (layout.hidden_in * layout.num_slices + sum(layout.out_sizes))


def costs_for(dtype: torch.dtype, device: torch.device) -> ScheduleCosts:
    """The calibrated costs of (dtype, device), measured on first ask and cached for the process."""
    key = (dtype, device.type)
    if key not in _COSTS:
        _COSTS[key] = calibrate(dtype, device)
    return _COSTS[key]


def set_costs(dtype: torch.dtype, device: torch.device, costs: ScheduleCosts | None) -> None:
    """Use `costs` for (dtype, device) from now on (None: calibrate again on next ask)."""
    if costs is None:
        _COSTS.pop((dtype, device.type), None)
    else:
        _COSTS[(dtype, device.type)] = costs


def bag_max_rows(seg_lens: Sequence[int], w_bytes: int, costs: ScheduleCosts) -> int:
    """Segments of at most this many rows go to bags, the rest to the loop; 0: no bags at all."""
    per_row = costs.bag_per_byte * w_bytes - costs.seg_per_row  # what a row in bags costs more
    saved = costs.seg_fixed + costs.seg_per_byte * w_bytes  # what a segment out of the loop saves
    lengths = [n for n in seg_lens if n > 0]  # 0: padding of fixed-capacity metadata

    def gain(n: int) -> float:  # predicted seconds saved by moving one segment of n rows to bags
        return saved - n * per_row

    limit = max((n for n in lengths if gain(n) > 0), default=0)
    if limit == 0 or sum(gain(n) for n in lengths if n <= limit) <= costs.bag_fixed:
        return 0
    return limit


def _time(fn: Callable[[], None]) -> float:
    fn()  # first call builds the plan's index lists and warms the weights
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def calibrate(dtype: torch.dtype, device: torch.device) -> ScheduleCosts:
    """Time both schedules on CALIBRATION_SHAPES x CALIBRATION_BATCHES; least-squares coefficients."""
    gen = torch.Generator().manual_seed(0)
    bag_rows, bag_seconds, loop_rows, loop_seconds = [], [], [], []
    for hidden_in, out_sizes in CALIBRATION_SHAPES:
        num_slots = 16
        lora_a, lora_b = alloc_stacks(
            num_slots, CALIBRATION_RANK, hidden_in, out_sizes, dtype=dtype, device=device
        )
        for w in (*lora_a, *lora_b):
            w.copy_(torch.randn(w.shape, generator=gen) * 0.02)
        layout = LoraLayout(len(out_sizes), num_slots, CALIBRATION_RANK, hidden_in, tuple(out_sizes))
        params = slot_params(torch.ones(num_slots), None, layout, device, may_sync=True)
        tables = bag_tables(lora_a, lora_b)
        assert tables is not None  # alloc_stacks gives the CPU layout on the CPU
        views = torch_fused.slot_views(lora_a, lora_b, tables, layout)
        w_bytes = weight_bytes(layout, torch.empty((), dtype=dtype).element_size())
        for num_segments, rows_each in CALIBRATION_BATCHES:
            slots = torch.arange(num_segments).repeat_interleave(rows_each).to(device)
            meta = build_meta(slots, num_slots)
            x = torch.randn(len(slots), hidden_in, generator=gen).to(device=device, dtype=dtype)
            y = torch.zeros(len(slots), sum(out_sizes), dtype=dtype, device=device)
            plan = torch_bag.plan(meta, rows_each)
            assert plan is not None
            bag_s = _time(lambda: torch_bag.add_lora_bag(y, x, tables, meta, plan, params, layout))  # noqa: B023
            loop_s = _time(lambda: torch_fused.add_lora_segments(y, x, views, meta, params, layout))  # noqa: B023
            bag_rows.append([1.0, float(w_bytes * len(slots))])
            bag_seconds.append(bag_s)
            loop_rows.append([float(num_segments), float(num_segments * w_bytes), float(len(slots))])
            loop_seconds.append(loop_s)
    bag_fixed, bag_per_byte = _fit(bag_rows, bag_seconds)
    seg_fixed, seg_per_byte, seg_per_row = _fit(loop_rows, loop_seconds)
    return ScheduleCosts(bag_fixed, bag_per_byte, seg_fixed, seg_per_byte, seg_per_row)


def _fit(features: list[list[float]], seconds: list[float]) -> list[float]:
    """Non-negative least-squares-ish coefficients: lstsq on column-normalised features, clamped at 0."""
    a = torch.tensor(features, dtype=torch.float64)
    norms = a.abs().amax(dim=0).clamp_min(1e-30)
    b = torch.tensor(seconds, dtype=torch.float64)[:, None]
    coef = torch.linalg.lstsq(a / norms, b).solution[:, 0] / norms
    return [max(0.0, float(c)) for c in coef]
