"""The two float64 oracles agree (the per-slot one serves the large GPU shapes)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.reference import POPULARITIES, make_case, reference_delta, reference_delta_by_slot


@pytest.mark.parametrize("popularity", POPULARITIES)
def test_per_slot_oracle_equals_per_row_oracle(popularity: str) -> None:
    case = make_case(num_tokens=24, hidden_in=20, out_sizes=(12, 5, 7), num_slots=6, max_rank=9,
                     popularity=popularity, dtype=torch.float32, seed=1)  # fmt: skip
    torch.testing.assert_close(reference_delta_by_slot(case), reference_delta(case), rtol=1e-12, atol=1e-12)
