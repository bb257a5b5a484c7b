"""The twin's padded-bmm schedule (many adapters with few rows each) against the float64 loop."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.sgmv import build_meta, torch_padded
from kernels.sgmv.checks import check_lora_a, slot_params
from tests.kernels.reference import assert_matches, expected_output, make_case, run_add_lora


def chosen(case) -> bool:
    layout = check_lora_a(case.lora_a)
    params = slot_params(case.scales, case.ranks, layout, case.x.device, may_sync=True)
    return torch_padded.use_padded(build_meta(case.token_slots, layout.num_slots), params)


@pytest.mark.parametrize("popularity", ["distinct", "uniform", "some_none"])
@pytest.mark.parametrize("out_sizes", [(24,), (16, 8, 8), (40, 40)])
@pytest.mark.parametrize("uniform_rank", [8, 5])
def test_padded_schedule_matches_loop_reference(popularity, out_sizes, uniform_rank) -> None:
    case = make_case(num_tokens=12, hidden_in=48, out_sizes=out_sizes, num_slots=12, max_rank=8,
                     popularity=popularity, dtype=torch.float32, seed=7, mixed_ranks=False)  # fmt: skip
    if uniform_rank < 8:  # garbage beyond the shared rank must never be read
        case.ranks.fill_(uniform_rank)
        for a, b in zip(case.lora_a, case.lora_b, strict=True):
            a[:, uniform_rank:] = math.nan
            b[:, :, uniform_rank:] = math.nan
    if not chosen(case):
        pytest.skip(f"{popularity}: too few segments for the padded schedule")
    expected = expected_output(case)
    before = case.buf.clone()
    run_add_lora(case, "torch")
    assert_matches(case, expected, before, torch.float32)


def test_padded_schedule_is_not_chosen_for_mixed_ranks_or_long_segments() -> None:
    mixed = make_case(num_tokens=12, hidden_in=32, out_sizes=(16,), num_slots=12, max_rank=8,
                      popularity="distinct", dtype=torch.float32, seed=1, mixed_ranks=True)  # fmt: skip
    assert not chosen(mixed)
    skewed = make_case(num_tokens=64, hidden_in=32, out_sizes=(16,), num_slots=8, max_rank=8,
                       popularity="skewed", dtype=torch.float32, seed=2, mixed_ranks=False)  # fmt: skip
    assert not chosen(skewed)
