"""build_meta: sorted order, segments and the one bounds check per step."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.sgmv import SgmvMeta, build_meta
from tests.kernels.reference import POPULARITIES, make_slots


def test_running_example_from_the_docstring() -> None:
    meta = build_meta(torch.tensor([1, -1, 0, 1, 1, 0]), 3)
    assert meta.sorted_rows.tolist() == [2, 5, 0, 3, 4]
    assert meta.sorted_slots.tolist() == [0, 0, 1, 1, 1]
    assert meta.seg_slots.tolist() == [0, 1] and meta.seg_slots_host == (0, 1)
    assert meta.seg_starts.tolist() == [0, 2] and meta.seg_starts_host == (0, 2)
    assert meta.seg_lens.tolist() == [2, 3] and meta.seg_lens_host == (2, 3)
    assert (meta.num_tokens, meta.num_slots, meta.num_active_rows) == (6, 3, 5)
    assert (meta.num_segments, meta.max_seg_len) == (2, 3)
    assert meta.seg_starts.dtype == meta.seg_lens.dtype == meta.seg_slots.dtype == torch.int32
    assert meta.sorted_rows.dtype == torch.int64


@pytest.mark.parametrize("popularity", POPULARITIES)
@pytest.mark.parametrize("num_tokens", [1, 2, 17, 128])
def test_segments_partition_the_rows_with_an_adapter(popularity: str, num_tokens: int) -> None:
    slots = make_slots(popularity, num_tokens, 16, random.Random(num_tokens))
    meta = build_meta(torch.tensor(slots, dtype=torch.int32), 16)
    active = [t for t, a in enumerate(slots) if a >= 0]
    assert sorted(meta.sorted_rows.tolist()) == active
    for start, length, slot in zip(
        meta.seg_starts_host, meta.seg_lens_host, meta.seg_slots_host, strict=True
    ):
        rows = meta.sorted_rows[start : start + length].tolist()
        assert rows == [t for t in active if slots[t] == slot]  # all of the slot's rows, in batch order
    assert list(meta.seg_slots_host) == sorted(set(slots) - {-1})
    assert meta.max_seg_len == max(meta.seg_lens_host, default=0)


def test_empty_batch() -> None:
    meta = build_meta(torch.empty(0, dtype=torch.int64), 4)
    assert (meta.num_tokens, meta.num_active_rows, meta.num_segments, meta.max_seg_len) == (0, 0, 0, 0)


@pytest.mark.parametrize("bad", [4, 7, -2])
def test_slot_out_of_range_names_row_and_slot(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"token_slots\[2\] = {bad}: expected -1 .* \[0, 4\)"):
        build_meta(torch.tensor([0, 3, bad, -1]), 4)


@pytest.mark.parametrize("slots", [torch.tensor([0.0, 1.0]), torch.tensor([[0, 1]]), [0, 1]])
def test_token_slots_must_be_a_1d_int_tensor(slots: object) -> None:
    with pytest.raises(ValueError, match="token_slots"):
        build_meta(slots, 2)  # type: ignore[arg-type]


def test_meta_is_frozen() -> None:
    meta = build_meta(torch.tensor([0]), 1)
    assert isinstance(meta, SgmvMeta)
    with pytest.raises(AttributeError):
        meta.num_tokens = 3  # type: ignore[misc]
