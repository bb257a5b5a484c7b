"""Fixed-capacity SGMV metadata (CUDA-graph-ready): one set of buffers and one launch grid serve any
set and number of adapters. Checked with the Triton kernels under the interpreter and with the twin:
the same buffers, rewritten in place for each step ("replay"), give the result of fresh metadata."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.sgmv import add_lora, build_meta
from kernels.sgmv.static_meta import StaticMeta

CAPACITY, NUM_SLOTS, H_IN, OUT_SIZES, R_MAX = 16, 6, 32, (24, 8), 16

STEPS = [  # the adapter set and size change from step to step, like decode batches do
    [0, 0, 1, -1, 2, 2, 2, 0],
    [5] * 16,
    [-1, -1, -1],
    [3, 1, 4, 1, 5, 0, 2, -1, 3, 3, 3, 3, 1, 0],
    [2],
]


def _weights(gen: torch.Generator):
    lora_a = [torch.randn(NUM_SLOTS, R_MAX, H_IN, generator=gen) * 0.3 for _ in OUT_SIZES]
    lora_b = [torch.randn(NUM_SLOTS, out, R_MAX, generator=gen) * 0.3 for out in OUT_SIZES]
    scales = torch.rand(len(OUT_SIZES), NUM_SLOTS, generator=gen) + 0.5
    ranks = torch.randint(1, R_MAX + 1, (len(OUT_SIZES), NUM_SLOTS), generator=gen, dtype=torch.int32)
    return lora_a, lora_b, scales, ranks


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(
            "triton",
            marks=pytest.mark.skipif(
                os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
            ),
        ),
        "torch",
    ],
)
def test_static_buffers_replay_any_adapter_set(backend: str) -> None:
    gen = torch.Generator().manual_seed(0)
    lora_a, lora_b, scales, ranks = _weights(gen)
    static = StaticMeta(CAPACITY, max_segments=NUM_SLOTS, num_slots=NUM_SLOTS, device=torch.device("cpu"))
    addresses = {t.data_ptr() for t in (static.sorted_rows, static.seg_lens, static.seg_slots)}
    for slots in STEPS:
        n = len(slots)
        x = torch.randn(CAPACITY, H_IN, generator=gen)
        token_slots = torch.tensor(slots, dtype=torch.long)
        expected = torch.randn(n, sum(OUT_SIZES), generator=gen)
        y = torch.zeros(CAPACITY, sum(OUT_SIZES))
        y[:n] = expected
        meta = static.update(token_slots)
        assert meta.num_segments == NUM_SLOTS and meta.max_seg_len == CAPACITY  # the same grid every step
        assert {meta.sorted_rows.data_ptr(), meta.seg_lens.data_ptr(), meta.seg_slots.data_ptr()} == addresses
        padded_slots = torch.full((CAPACITY,), -1, dtype=torch.long)
        padded_slots[:n] = token_slots
        add_lora(y, x, lora_a, lora_b, padded_slots, scales=scales, ranks=ranks, meta=meta, backend=backend)
        add_lora(expected, x[:n], lora_a, lora_b, token_slots, scales=scales, ranks=ranks,
                 meta=build_meta(token_slots, NUM_SLOTS), backend=backend)  # fmt: skip
        torch.testing.assert_close(y[:n], expected, rtol=1e-5, atol=1e-5)
        assert torch.count_nonzero(y[n:]) == 0  # padded rows stay untouched


def test_static_meta_refuses_what_does_not_fit() -> None:
    static = StaticMeta(4, max_segments=2, num_slots=NUM_SLOTS, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="exceed the capacity 4"):
        static.update(torch.tensor([0, 1, 2, 3, 4]))
    with pytest.raises(ValueError, match="3 adapters in one step exceed max_segments 2"):
        static.update(torch.tensor([0, 1, 2]))
