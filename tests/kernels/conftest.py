"""Kernel tests pick the CPU twin's schedules from fixed costs (no timing in tests): the bag vs segment
loop split of each case is then the same on every machine and every run."""

from __future__ import annotations

import pytest
import torch

from kernels.sgmv import cost_model

# About what cost_model.calibrate measures at bench-small widths (hidden 512, rank 16, one thread): a
# bag row ~55 us per 164 KB of adapter weights, a loop segment ~100 us + 15 us per row, the bag
# schedule ~150 us once. With these, one- and two-row segments of bench-small take bags.
REFERENCE_COSTS = cost_model.ScheduleCosts(
    bag_fixed=150e-6, bag_per_byte=3.3e-10, seg_fixed=100e-6, seg_per_byte=0.0, seg_per_row=15e-6
)


@pytest.fixture(autouse=True)
def fixed_schedule_costs() -> None:
    cpu = torch.device("cpu")
    saved = {dtype: cost_model._COSTS.get((dtype, "cpu")) for dtype in (torch.float32, torch.bfloat16)}
    for dtype in saved:
        cost_model.set_costs(dtype, cpu, REFERENCE_COSTS)
    yield
    for dtype, costs in saved.items():
        cost_model.set_costs(dtype, cpu, costs)
