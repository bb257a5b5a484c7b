"""add_lora's per-slot output scale and shift (DoRA) against the float64 loop, on every schedule.

Odd slots carry a scale in [0.5, 1.5] and a shift per column, even slots exactly 1 and 0 (plain LoRA):
a mixed batch of DoRA, plain-LoRA and -1 rows is one call, plain rows come out bit-identical to a call
without the vectors, and -1 rows and guard columns keep their bits (assert_matches).
"""

from __future__ import annotations

import pytest
import torch

from kernels.sgmv import build_meta, cost_model, torch_bag, torch_fused, torch_ops
from kernels.sgmv.cost_model import ScheduleCosts
from tests.kernels.reference import (
    assert_matches,
    bits,
    expected_output,
    make_case,
    make_out_vectors,
    run_add_lora,
    to_cpu_layout,
)

SCHEDULES = ("loop", "gather", "bag", "fused")


def _case(schedule: str, popularity: str, seed: int, dtype: torch.dtype = torch.float32):
    # the CPU layout's schedule is pinned by _pin's costs (bags: 6 one-row segments; fused: the rest)
    case = make_case(
        num_tokens=6 if schedule == "bag" else 24, hidden_in=40, out_sizes=(24, 8, 8), num_slots=6,
        max_rank=8, popularity="distinct" if schedule == "bag" else popularity, dtype=dtype, seed=seed,
    )  # fmt: skip
    return to_cpu_layout(case) if schedule in ("bag", "fused") else case


def _pin(monkeypatch: pytest.MonkeyPatch, schedule: str) -> None:
    """Pin the twin's schedule; bag and fused must then be the ones that ran."""
    monkeypatch.setattr(torch_ops, "use_gather", lambda *args: schedule == "gather")
    if schedule not in ("bag", "fused"):
        return
    # bag: bags free, a loop segment 1 s; fused: the bag schedule costs 1 s to start (cost_model.py)
    bag_fixed, seg_fixed = (0.0, 1.0) if schedule == "bag" else (1.0, 0.0)
    costs = ScheduleCosts(bag_fixed, 0.0, seg_fixed, 0.0, 0.0)
    monkeypatch.setattr(cost_model, "costs_for", lambda dtype, device: costs)
    module = torch_bag if schedule == "bag" else torch_fused
    name = "add_lora_bag" if schedule == "bag" else "add_lora_segments"
    original = getattr(module, name)

    def must_run(*args: object, **kwargs: object) -> object:
        must_run.calls += 1  # type: ignore[attr-defined]
        return original(*args, **kwargs)

    must_run.calls = 0  # type: ignore[attr-defined]
    monkeypatch.setattr(module, name, must_run)
    _SPIES.append(must_run)


_SPIES: list = []


@pytest.fixture(autouse=True)
def _schedules_ran():
    _SPIES.clear()
    yield
    assert all(spy.calls > 0 for spy in _SPIES), "the pinned CPU schedule did not run"


@pytest.mark.parametrize("with_shift", [False, True])
@pytest.mark.parametrize("popularity", ["distinct", "uniform", "some_none", "zipf"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_twin_rescales_after_the_delta(
    schedule: str, popularity: str, with_shift: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    _pin(monkeypatch, schedule)
    case = _case(schedule, popularity, seed=7)
    scale, shift = make_out_vectors(case, seed=1, with_shift=with_shift)
    expected = expected_output(case, out_scale=scale, out_shift=shift)
    before = case.buf.clone()
    run_add_lora(case, "torch", out_scale=scale, out_shift=shift)
    assert_matches(case, expected, before, torch.float32)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_plain_lora_rows_are_bit_identical_to_a_call_without_vectors(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _pin(monkeypatch, schedule)
    with_vectors, plain = _case(schedule, "distinct", seed=3), _case(schedule, "distinct", seed=3)
    scale, _ = make_out_vectors(with_vectors, seed=2, with_shift=False)
    run_add_lora(with_vectors, "torch", out_scale=scale)
    run_add_lora(plain, "torch")
    even = (with_vectors.token_slots % 2 == 0) & (with_vectors.token_slots >= 0)
    assert even.any()
    assert torch.equal(bits(with_vectors.y[even]), bits(plain.y[even]))


def test_batch_invariant_meta_rescales_too() -> None:
    case = _case("bag", "some_none", seed=5)
    scale, shift = make_out_vectors(case, seed=3, with_shift=True)
    expected, before = expected_output(case, out_scale=scale, out_shift=shift), case.buf.clone()
    meta = build_meta(case.token_slots, case.lora_a[0].shape[0], invariant=True)
    run_add_lora(case, "torch", meta=meta, out_scale=scale, out_shift=shift)
    assert_matches(case, expected, before, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("popularity", ["distinct", "uniform", "some_none"])
def test_triton_rescales_in_the_expand(popularity: str, dtype: torch.dtype) -> None:
    case = _case("loop", popularity, seed=11, dtype=dtype)
    case.ranks[1, 1] = 0  # a DoRA slot with no factors in slice 1: its columns are still rescaled
    scale, shift = make_out_vectors(case, seed=4, with_shift=True)
    expected, before = expected_output(case, out_scale=scale, out_shift=shift), case.buf.clone()
    run_add_lora(case, "triton", out_scale=scale, out_shift=shift)
    assert_matches(case, expected, before, dtype)


def test_bad_vectors_are_refused_by_name() -> None:
    case = _case("loop", "uniform", seed=1)
    scale, shift = make_out_vectors(case, seed=1, with_shift=True)
    assert shift is not None
    with pytest.raises(
        ValueError, match=r"out_scale has shape \(6, 39\), expected \[N, sum\(H_out\)\] = \[6, 40\]"
    ):
        run_add_lora(case, "torch", out_scale=scale[:, :39])
    with pytest.raises(ValueError, match="out_shift was given without out_scale"):
        run_add_lora(case, "torch", out_shift=shift)
    with pytest.raises(ValueError, match="out_scale is torch.float64"):
        run_add_lora(case, "torch", out_scale=scale.double())
