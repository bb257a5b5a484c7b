"""The twin on the CPU slot layout (layout.alloc_stacks): bag schedule and fused shrinks vs the float64 loop.

Weights hold NaN beyond each slot's rank and in unused slots (see reference.make_case): the bag shrink
reads whole table rows, so any leak of those columns into y would show as NaN in the output.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels.sgmv import build_meta, cost_model, sgmv_expand, sgmv_shrink, torch_bag, torch_fused
from kernels.sgmv.layout import alloc_stacks, bag_tables
from tests.kernels.reference import (
    POPULARITIES,
    Case,
    assert_matches,
    expected_output,
    make_case,
    run_add_lora,
    to_cpu_layout,
)

CPU = torch.device("cpu")


def cpu_case(**kwargs: object) -> Case:
    """make_case (fp32 unless given) moved into the CPU layout."""
    return to_cpu_layout(make_case(**{"dtype": torch.float32, **kwargs}))


def repoison(case: Case) -> Case:
    """After overriding slots or ranks: NaN again beyond every slot's rank and in every unused slot."""
    s_count, n = len(case.lora_a), case.lora_a[0].shape[0]
    ranks = case.ranks.expand(s_count, n)
    used = torch.zeros(n, dtype=torch.bool)
    used[case.token_slots[case.token_slots >= 0]] = True
    for s, (a, b) in enumerate(zip(case.lora_a, case.lora_b, strict=True)):
        beyond = torch.arange(a.shape[1])[None, :] >= ranks[s][:, None]  # [N, R]
        a.masked_fill_(beyond[:, :, None] | ~used[:, None, None], float("nan"))
        b.masked_fill_(beyond[:, None, :] | ~used[:, None, None], float("nan"))
    return case


class Spy:
    """Counts calls of the bag schedule and of the fused per-segment shrink."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bag = self.fused = 0
        bag, fused = torch_bag.add_lora_bag, torch_fused.add_lora_segments

        def count_bag(*args: object) -> None:
            self.bag += 1
            bag(*args)

        def count_fused(*args: object) -> list:
            self.fused += 1
            return fused(*args)

        monkeypatch.setattr(torch_bag, "add_lora_bag", count_bag)
        monkeypatch.setattr(torch_fused, "add_lora_segments", count_fused)


def grid(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        dict(
            popularity=POPULARITIES[i % len(POPULARITIES)],
            num_tokens=rng.choice((1, 2, 5, 16, 33, 64)),
            hidden_in=rng.choice((16, 37, 64)),
            out_sizes=rng.choice(((16,), (37,), (48, 16), (40, 8, 24))),
            num_slots=rng.choice((3, 8, 16)),
            max_rank=rng.choice((1, 4, 16, 33)),
            mixed_ranks=rng.random() < 0.7,
            per_slice=rng.random() < 0.5,
            shuffle=rng.random() < 0.7,
            seed=1000 + i,
        )
        for i in range(count)
    ]


GRID = grid(42, seed=7)


@pytest.mark.parametrize("cfg", GRID, ids=[f"{c['popularity']}-{c['seed']}" for c in GRID])
def test_cpu_layout_matches_float64_loop(cfg: dict) -> None:
    case = cpu_case(**cfg)
    expected, before = expected_output(case), case.buf.clone()
    run_add_lora(case, "torch")
    assert_matches(case, expected, before, torch.float32)


def test_distinct_rows_take_the_bag_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    case = cpu_case(num_tokens=12, hidden_in=64, out_sizes=(32, 16, 16), num_slots=12, max_rank=16,
                    popularity="distinct", seed=3)  # fmt: skip
    expected, before = expected_output(case), case.buf.clone()
    run_add_lora(case, "torch")
    assert_matches(case, expected, before, torch.float32)
    assert (spy.bag, spy.fused) == (1, 0)


def test_long_and_short_segments_split_between_bag_and_fused_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill run of 20 rows of one adapter (GEMM) beside four decodes and a pair (bags), shuffled;
    costs where a bag row costs 20 us and a loop segment 100 us: bags for segments of < 5 rows."""
    spy = Spy(monkeypatch)
    w_bytes = 4 * 8 * (48 * 2 + 48)  # fp32, rank 8, two slices of A [48], B outputs 32 + 16
    costs = cost_model.ScheduleCosts(0.0, 20e-6 / w_bytes, 100e-6, 0.0, 0.0)
    monkeypatch.setattr(cost_model, "costs_for", lambda dtype, device: costs)
    case = make_case(num_tokens=26, hidden_in=48, out_sizes=(32, 16), num_slots=7, max_rank=8,
                     popularity="distinct", dtype=torch.float32, seed=4, mixed_ranks=False)  # fmt: skip
    slots = [2] * 20 + [0, 5, 3, 6, 1, 1]
    random.Random(1).shuffle(slots)
    case.token_slots = torch.tensor(slots)
    case.ranks = torch.tensor([[8, 1, 5, 2, 8, 3, 7], [2, 8, 8, 4, 1, 6, 0]])
    case = to_cpu_layout(repoison(case))
    expected, before = expected_output(case), case.buf.clone()
    run_add_lora(case, "torch")
    assert_matches(case, expected, before, torch.float32)
    assert (spy.bag, spy.fused) == (1, 1)


def test_rank_zero_slices_and_rows_without_adapter_in_bags() -> None:
    """A q-only adapter (k/v rank 0) among full ones, -1 rows interleaved: bag bags of 0..R rows."""
    case = make_case(num_tokens=16, hidden_in=32, out_sizes=(32, 8, 8), num_slots=5, max_rank=8,
                     popularity="distinct", dtype=torch.float32, seed=9, mixed_ranks=False)  # fmt: skip
    case.ranks = torch.tensor([[8, 3, 8, 1, 8], [0, 8, 2, 0, 8], [0, 8, 8, 5, 0]])
    case.token_slots = torch.tensor([0, -1, 1, 2, 3, -1, 4, 0, 1, -1, 2, 3, 4, 0, -1, 1])
    case = to_cpu_layout(repoison(case))
    expected, before = expected_output(case), case.buf.clone()
    run_add_lora(case, "torch")
    assert_matches(case, expected, before, torch.float32)


def test_float16_on_cpu_layout_uses_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    case = cpu_case(num_tokens=9, hidden_in=32, out_sizes=(16, 16), num_slots=9, max_rank=8,
                    popularity="distinct", dtype=torch.float16, seed=2)  # fmt: skip
    expected, before = expected_output(case), case.buf.clone()
    run_add_lora(case, "torch")
    assert_matches(case, expected, before, torch.float16)
    assert (spy.bag, spy.fused) == (0, 0)


@pytest.mark.parametrize("cfg", GRID[:21], ids=[f"{c['popularity']}-{c['seed']}" for c in GRID[:21]])
def test_bfloat16_cpu_layout_matches_float64_loop(cfg: dict) -> None:
    """bf16 stacks take the same bag / fused-loop schedules as fp32 (FBGEMM bags and oneDNN GEMMs
    accumulate in fp32), within reference.TOLERANCES[bfloat16] (the bound is explained there)."""
    case = cpu_case(**{**cfg, "dtype": torch.bfloat16})
    expected, before = expected_output(case), case.buf.clone()
    run_add_lora(case, "torch")
    assert_matches(case, expected, before, torch.bfloat16)


def test_bfloat16_distinct_rows_take_the_bag_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch)
    case = cpu_case(num_tokens=12, hidden_in=64, out_sizes=(32, 16, 16), num_slots=12, max_rank=16,
                    popularity="distinct", dtype=torch.bfloat16, seed=3)  # fmt: skip
    expected, before = expected_output(case), case.buf.clone()
    run_add_lora(case, "torch")
    assert_matches(case, expected, before, torch.bfloat16)
    assert (spy.bag, spy.fused) == (1, 0)


def test_shrink_and_expand_building_blocks_on_cpu_layout() -> None:
    case = cpu_case(num_tokens=10, hidden_in=32, out_sizes=(24, 8), num_slots=10, max_rank=8,
                    popularity="distinct", seed=6)  # fmt: skip
    expected, before = expected_output(case), case.buf.clone()
    meta = build_meta(case.token_slots, 10)
    args = dict(meta=meta, ranks=case.ranks, backend="torch")
    v = sgmv_shrink(case.x, case.lora_a, case.token_slots, scales=case.scales, **args)
    sgmv_expand(case.y, v, case.lora_b, case.token_slots, **args)
    assert_matches(case, expected, before, torch.float32)


def test_bag_tables_recognise_only_the_cpu_layout() -> None:
    lora_a, lora_b = alloc_stacks(4, 8, 32, (16, 8, 8), dtype=torch.float32, device=CPU)
    tables = bag_tables(lora_a, lora_b)
    assert tables is not None
    assert tables.a.shape == (4 * 32, 8 * 3) and [t.shape for t in tables.b] == [(32, 16), (32, 8), (32, 8)]
    lora_a[1][2, 5, 7] = 3.0  # slot 2, rank 5, input 7 of slice 1 -> row 2*32+7, column 5*3+1
    lora_b[2][3, 6, 4] = 4.0  # slot 3, output 6, rank 4 of slice 2 -> row 3*8+4, column 6
    assert tables.a[2 * 32 + 7, 5 * 3 + 1] == 3.0 and tables.b[2][3 * 8 + 4, 6] == 4.0
    contiguous = [torch.zeros(4, 8, 32) for _ in range(3)]
    assert bag_tables(contiguous, lora_b) is None
    assert bag_tables(lora_a, [torch.zeros(4, h, 8) for h in (16, 8, 8)]) is None
    assert bag_tables([lora_a[0], lora_a[2], lora_a[1]], lora_b) is None  # slices out of order
    assert bag_tables(lora_a[:2], lora_b[:2]) is None  # two of three interleaved slices


def test_empty_and_all_none_batches_leave_y_alone() -> None:
    for num_tokens, popularity in ((0, "distinct"), (7, "all_none")):
        case = cpu_case(num_tokens=num_tokens, hidden_in=16, out_sizes=(16,), num_slots=4, max_rank=4,
                        popularity=popularity, seed=1)  # fmt: skip
        before = case.buf.clone()
        run_add_lora(case, "torch")
        assert torch.equal(case.buf, before)


def test_scales_and_ranks_changed_in_place_are_seen_by_the_next_call() -> None:
    """The host copies of scales/ranks are memoised per tensor version: a slot rewrite must show."""
    case = cpu_case(num_tokens=6, hidden_in=16, out_sizes=(16, 8), num_slots=3, max_rank=4,
                    popularity="distinct", seed=8, mixed_ranks=False)  # fmt: skip
    meta = build_meta(case.token_slots, 3)
    run_add_lora(case, "torch", meta=meta)
    case.scales[..., 1] = 3.0  # as SlotPool.write does when a new adapter lands in slot 1
    case.ranks[..., 2] = 2
    expected, before = expected_output(case), case.buf.clone()
    run_add_lora(case, "torch", meta=meta)
    assert_matches(case, expected, before, torch.float32)


def test_per_slot_views_follow_the_stacks_they_were_made_for() -> None:
    """The fused loop memoises per-slot views on lora_a[0]: other B stacks with the same A must not
    reuse them, and rewriting a slot's weights in place must show in the next call."""
    case = cpu_case(num_tokens=8, hidden_in=16, out_sizes=(16, 8), num_slots=2, max_rank=4,
                    popularity="identical", seed=12, mixed_ranks=False)  # fmt: skip
    for _ in range(2):
        expected, before = expected_output(case), case.buf.clone()
        run_add_lora(case, "torch")
        assert_matches(case, expected, before, torch.float32)
        _, other_b = alloc_stacks(2, 4, 16, (16, 8), dtype=torch.float32, device=CPU)
        for dst, src in zip(other_b, case.lora_b, strict=True):
            dst.copy_(src * -2.0)
        case.lora_b = other_b
    for a in case.lora_a:
        a.mul_(0.5)  # a slot rewrite in place
    expected, before = expected_output(case), case.buf.clone()
    run_add_lora(case, "torch")
    assert_matches(case, expected, before, torch.float32)


@pytest.mark.parametrize("popularity", ["distinct", "some_none"])
def test_wide_full_rank_expand_in_column_pieces(popularity: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Wide slices of full-rank batches expand in pieces of EXPAND_CHUNK columns (shrunk here)."""
    monkeypatch.setattr(torch_bag, "EXPAND_CHUNK", 16)
    monkeypatch.setattr(torch_bag, "EXPAND_CHUNKED_MIN", 32)
    case = cpu_case(num_tokens=20, hidden_in=24, out_sizes=(48, 8, 32), num_slots=24, max_rank=8,
                    popularity=popularity, seed=13, mixed_ranks=False)  # fmt: skip
    expected, before = expected_output(case), case.buf.clone()
    run_add_lora(case, "torch")
    assert_matches(case, expected, before, torch.float32)
