"""lora_b as a transposed view of rank-major storage (the engine's slot-pool layout) in both backends."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.reference import assert_matches, expected_output, make_case, run_add_lora


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("popularity", ["distinct", "skewed", "some_none"])
def test_rank_major_lora_b_view(backend: str, popularity: str) -> None:
    case = make_case(num_tokens=10, hidden_in=32, out_sizes=(16, 24), num_slots=5, max_rank=16,
                     popularity=popularity, dtype=torch.float32, seed=11)  # fmt: skip
    case.lora_b = [b.transpose(1, 2).contiguous().transpose(1, 2) for b in case.lora_b]
    assert not case.lora_b[0].is_contiguous()
    expected = expected_output(case)
    before = case.buf.clone()
    run_add_lora(case, backend)
    assert_matches(case, expected, before, torch.float32)
