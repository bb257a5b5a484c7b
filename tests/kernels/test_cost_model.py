"""kernels/sgmv/cost_model.py: the CPU twin's bag / segment-loop pick follows the costs it is given
(injected here, never timed), the fit recovers known coefficients, calibration runs once per dtype."""

from __future__ import annotations

import pytest
import torch

from kernels.sgmv import add_lora, build_meta, cost_model, torch_bag, torch_fused
from kernels.sgmv.checks import LoraLayout
from kernels.sgmv.cost_model import ScheduleCosts, bag_max_rows
from kernels.sgmv.layout import alloc_stacks

CPU = torch.device("cpu")
W = 100_000  # bytes of one adapter's weights for the projection


def costs(*, bag_row_us: float, bag_fixed_us: float = 0.0, seg_us: float = 100.0, row_us: float = 0.0):
    return ScheduleCosts(bag_fixed_us * 1e-6, bag_row_us * 1e-6 / W, seg_us * 1e-6, 0.0, row_us * 1e-6)


def test_segments_shorter_than_the_break_even_take_bags() -> None:
    # a bag row 30 us, a loop segment 100 us: segments of up to 3 rows save by moving to bags
    assert bag_max_rows([1, 2, 3, 4, 9], W, costs(bag_row_us=30)) == 3
    # with 15 us per row in the loop too, a bag row costs 15 us more: up to 6 rows
    assert bag_max_rows([1, 2, 3, 4, 9], W, costs(bag_row_us=30, row_us=15)) == 4
    assert bag_max_rows([1, 6, 7, 40], W, costs(bag_row_us=30, row_us=15)) == 6
    # bags costlier than a whole segment per row: none
    assert bag_max_rows([1, 1, 1], W, costs(bag_row_us=200)) == 0


def test_bags_start_only_when_the_saving_beats_their_fixed_cost() -> None:
    # two one-row segments save 2 * 70 us = 140 us: not worth a 150 us bag schedule; four save 280 us
    assert bag_max_rows([1, 1], W, costs(bag_row_us=30, bag_fixed_us=150)) == 0
    assert bag_max_rows([1, 1, 1, 1], W, costs(bag_row_us=30, bag_fixed_us=150)) == 1
    assert bag_max_rows([0, 0, 1, 1, 1, 1], W, costs(bag_row_us=30, bag_fixed_us=150)) == 1  # 0: padding
    # heavier adapters (the same per-byte cost, 4x the bytes): one-row bags no longer pay
    heavy = costs(bag_row_us=30, bag_fixed_us=150)
    assert bag_max_rows([1, 1, 1, 1], 4 * W, heavy) == 0


def _count(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = {"bag": 0, "loop": 0}
    bag, loop = torch_bag.add_lora_bag, torch_fused.add_lora_segments

    def count_bag(*args: object) -> None:
        calls["bag"] += 1
        bag(*args)

    def count_loop(*args: object) -> None:
        calls["loop"] += 1
        loop(*args)

    monkeypatch.setattr(torch_bag, "add_lora_bag", count_bag)
    monkeypatch.setattr(torch_fused, "add_lora_segments", count_loop)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("bag_row_us", "want"), [(1.0, (1, 0)), (30.0, (1, 1)), (500.0, (0, 1))], ids=["all", "split", "none"]
)
def test_add_lora_takes_the_schedule_the_costs_predict_cheaper(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, bag_row_us: float, want: tuple[int, int]
) -> None:
    """Eight decodes and one 20-row prefill run of 9 adapters: per-row bag costs 1 us (all in bags),
    30 us (decodes in bags, the prefill run in the loop) or 500 us (all in the loop); and the
    result is the same delta whichever schedule ran."""
    hidden, rank, slots = 64, 8, 9
    lora_a, lora_b = alloc_stacks(slots, rank, hidden, (32, 16), dtype=dtype, device=CPU)
    gen = torch.Generator().manual_seed(0)
    for w in (*lora_a, *lora_b):
        w.copy_(torch.randn(w.shape, generator=gen))
    w_bytes = cost_model.weight_bytes(
        LoraLayout(2, slots, rank, hidden, (32, 16)), torch.empty((), dtype=dtype).element_size()
    )
    given = ScheduleCosts(0.0, bag_row_us * 1e-6 / w_bytes, 100e-6, 0.0, 0.0)
    monkeypatch.setattr(cost_model, "costs_for", lambda d, device: given)
    token_slots = torch.tensor(list(range(8)) + [8] * 20)
    x = torch.randn(len(token_slots), hidden, generator=gen).to(dtype)
    y = torch.zeros(len(token_slots), 48, dtype=dtype)
    calls = _count(monkeypatch)
    add_lora(y, x, lora_a, lora_b, token_slots, scales=torch.ones(slots), meta=build_meta(token_slots, slots))
    assert (calls["bag"], calls["loop"]) == want
    pairs = list(zip(lora_a, lora_b, strict=True))
    rows = [
        torch.cat([x[t].double() @ a[s].double().t() @ b[s].double().t() for a, b in pairs])
        for t, s in enumerate(token_slots.tolist())
    ]
    ref = torch.stack(rows)  # float64 loop: row t, slot s, slices side by side
    tol = 5e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_fit_recovers_known_coefficients() -> None:
    # seconds = 2e-4 + 3e-10 * bytes, exactly: the fit finds both (features scaled as calibrate's)
    features = [[1.0, b] for b in (1e4, 1e5, 5e5, 2e6)]
    seconds = [2e-4 + 3e-10 * f[1] for f in features]
    fixed, per_byte = cost_model._fit(features, seconds)
    assert fixed == pytest.approx(2e-4, rel=1e-6) and per_byte == pytest.approx(3e-10, rel=1e-6)
    # a negative fit (noise) is clamped to zero, never a negative cost
    assert cost_model._fit([[1.0, 1.0], [1.0, 2.0]], [2e-4, 1e-4])[1] == 0.0


def test_calibration_runs_once_per_dtype_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[torch.dtype] = []
    measured = costs(bag_row_us=30)

    def fake_calibrate(dtype: torch.dtype, device: torch.device) -> ScheduleCosts:
        asked.append(dtype)
        return measured

    monkeypatch.setattr(cost_model, "calibrate", fake_calibrate)
    monkeypatch.setattr(cost_model, "_COSTS", {})
    for _ in range(3):
        assert cost_model.costs_for(torch.float32, CPU) is measured
        assert cost_model.costs_for(torch.bfloat16, CPU) is measured
    assert asked == [torch.float32, torch.bfloat16]
