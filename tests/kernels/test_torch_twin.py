"""The PyTorch twin of add_lora against the float64 loop oracle, over the issue's grid.

Both schedules (segment loop, gather + bmm) run on every case: the `schedule` fixture pins the choice.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from kernels.sgmv import build_meta, sgmv_expand, sgmv_shrink, torch_ops
from kernels.sgmv.checks import LoraLayout, slot_params
from tests.kernels.reference import (
    POPULARITIES,
    assert_matches,
    case_id,
    check_rank_zero,
    check_shrink,
    expected_output,
    make_case,
    poisoned,
    run_add_lora,
    small_case,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
AXES = {
    "num_tokens": (1, 2, 7, 16, 33, 64, 128),
    "hidden_in": (16, 37, 64, 100),
    "out_sizes": ((16,), (37,), (48, 16), (40, 8, 24), (33, 17, 9)),
    "num_slots": (1, 3, 8, 16),
    "max_rank": (1, 4, 8, 16, 33, 64),
    "mixed_ranks": (True, True, True, False),
    "per_slice": (True, False),
    "shuffle": (True, False),
}


def grid(per_cell: int, seed: int) -> list[dict]:
    """Every popularity x dtype x schedule cell, `per_cell` draws of the other axes (fixed seed)."""
    rng = random.Random(seed)
    cells = itertools.product(POPULARITIES, DTYPES, ("loop", "gather"))
    return [
        {"popularity": pop, "dtype": dtype, "schedule": sched, "seed": 100 * i + j}
        | {axis: rng.choice(values) for axis, values in AXES.items()}
        for i, (pop, dtype, sched) in enumerate(cells)
        for j in range(per_cell)
    ]


@pytest.fixture(params=["loop", "gather"])
def schedule(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> str:
    """Pin the twin's schedule (its heuristic would pick one per shape)."""
    monkeypatch.setattr(torch_ops, "use_gather", lambda *args: request.param == "gather")
    return request.param


GRID = grid(per_cell=3, seed=3)


@pytest.mark.parametrize("cfg", GRID, ids=[case_id(c) for c in GRID])
def test_add_lora_matches_float64_loop(cfg: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_ops, "use_gather", lambda *args: cfg["schedule"] == "gather")
    case = make_case(**{k: v for k, v in cfg.items() if k != "schedule"})
    expected, before = expected_output(case), case.buf.clone()
    run_add_lora(case, "torch")
    assert_matches(case, expected, before, cfg["dtype"])


def test_prebuilt_meta_is_used_and_token_slots_not_reexamined(schedule: str) -> None:
    case = small_case(seed=5)
    expected, before = expected_output(case), case.buf.clone()
    meta = build_meta(case.token_slots, 4)
    garbage = torch.full_like(case.token_slots, 99)  # out of range: would raise if examined
    run_add_lora(case, "torch", token_slots=garbage, meta=meta)
    assert_matches(case, expected, before, torch.float32)


def test_rank_zero_adds_nothing_and_reads_nothing(schedule: str) -> None:
    check_rank_zero("torch")


@pytest.mark.parametrize("num_slices", [4, 5])
def test_more_slices_than_one_triton_launch(schedule: str, num_slices: int) -> None:
    outs = tuple(8 + 3 * s for s in range(num_slices))
    case = small_case(out_sizes=outs, popularity="distinct", num_tokens=12, seed=num_slices)
    expected, before = expected_output(case), case.buf.clone()
    run_add_lora(case, "torch")
    assert_matches(case, expected, before, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_building_blocks_compose_to_add_lora(schedule: str, dtype: torch.dtype) -> None:
    case = small_case(num_tokens=20, hidden_in=40, out_sizes=(24, 8, 8), num_slots=6, max_rank=16,
                      popularity="zipf", dtype=dtype, seed=11)  # fmt: skip
    v = sgmv_shrink(
        case.x, case.lora_a, case.token_slots, scales=case.scales, ranks=case.ranks, backend="torch"
    )
    check_shrink(case, v)
    expected, before = expected_output(case), case.buf.clone()
    sgmv_expand(case.y, poisoned(v), case.lora_b, case.token_slots, ranks=case.ranks, backend="torch")
    assert_matches(case, expected, before, dtype)


def test_zero_tokens_is_a_no_op() -> None:
    case = small_case(num_tokens=0, popularity="all_none")
    before = case.buf.clone()
    run_add_lora(case, "torch")
    assert torch.equal(case.buf, before)
    v = sgmv_shrink(case.x, case.lora_a, case.token_slots, scales=case.scales, backend="torch")
    assert v.shape == (2, 0, 8)


def test_y_with_column_stride_two_keeps_the_columns_between() -> None:
    case = small_case(num_tokens=10, out_sizes=(12, 4), seed=4)
    wide = torch.randn(10, 32)
    before = wide.clone()
    case.y = wide[:, 0:32:2]  # column stride 2: the odd columns belong to someone else
    expected = expected_output(case)
    run_add_lora(case, "torch")
    torch.testing.assert_close(case.y.double(), expected, rtol=5e-5, atol=5e-5)
    assert torch.equal(wide[:, 1::2], before[:, 1::2])
    idle = case.token_slots < 0
    assert torch.equal(wide[idle], before[idle])


def pick_gather(hidden: int, tokens: int, slots: int) -> bool:
    layout = LoraLayout(1, slots, 16, hidden, (hidden,))
    params = slot_params(torch.ones(slots), None, layout, torch.device("cpu"), may_sync=True)
    return torch_ops.use_gather(build_meta(torch.arange(tokens) % slots, slots), layout, params)


def test_heuristic_loops_over_heavy_adapters_and_gathers_many_tiny_ones() -> None:
    assert pick_gather(hidden=64, tokens=32, slots=32)  # 32 one-row segments of 8 KiB adapters
    assert not pick_gather(hidden=4096, tokens=32, slots=32)  # 512 KiB per adapter: read each once
    assert not pick_gather(hidden=64, tokens=32, slots=2)  # two long segments
