"""Fewer OpenMP parallel regions per CPU decode step, same bits (issue #25 item 5).

Each region's join waits for every intra-op thread; on shared cores a descheduled thread stalls it for a
time slice. These tests check, with torch.profiler, that the decode step's small ops no longer run as
parallel aten ops (more than ATen's 32768-element grain size) and, bit for bit, that results are what
the one-op forms give.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from base_engine.model.decoder import LOGITS_CHUNK, _head
from base_engine.model.gated import GRAIN_SIZE, MAX_PIECES, gated
from base_engine.runner.attention import AttentionMetadata, attend
from base_engine.runner.decode_buckets import build_decode_buckets


def _calls(fn, name: str) -> list[list]:  # noqa: ANN001
    """Input shapes of each call of aten op `name` while fn() runs."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [e.input_shapes for e in prof.events() if e.name == name]


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize(
    ("rows", "width"), [(32, 1408), (64, 1536), (30, 2048), (7, 5000), (3, 40000), (1, 8)]
)
def test_gated_is_bit_identical_to_one_op(dtype: torch.dtype, gelu: bool, rows: int, width: int) -> None:
    gate_up = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(rows)).to(dtype)
    gate, up = gate_up.split(width, dim=-1)
    want = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    assert torch.equal(gated(gate, up, gelu=gelu), want)


def test_gated_runs_a_decode_batch_below_the_grain_size_and_prefill_as_one_op() -> None:
    gate, up = torch.randn(32, 1408), torch.randn(32, 1408)  # 45056 elements: one parallel op each
    shapes = _calls(lambda: gated(gate, up), "aten::silu") + _calls(lambda: gated(gate, up), "aten::mul")
    assert len(shapes) == 4 and all(_numel(s[0]) <= GRAIN_SIZE for s in shapes)
    rows = MAX_PIECES * (GRAIN_SIZE // 1408) + 1  # past MAX_PIECES pieces: the threads are worth a join
    big = torch.randn(rows, 1408)
    assert [s[0] for s in _calls(lambda: gated(big, big), "aten::silu")] == [[rows, 1408]]
    odd = torch.randn(32, 1400)  # rows not whole SIMD vectors: one op (its tails round as one op's do)
    assert [s[0] for s in _calls(lambda: gated(odd, odd), "aten::silu")] == [[32, 1400]]


@pytest.mark.parametrize("rows", [1, 32, 64])
def test_lm_head_chunks_write_in_place_with_the_same_bits(rows: int) -> None:
    hidden = torch.randn(rows, 64)
    weight = torch.randn(3 * LOGITS_CHUNK + 100, 64)
    out = _head(hidden, weight, invariant=False)
    want = torch.cat(
        [F.linear(hidden, weight[s : s + LOGITS_CHUNK]) for s in range(0, weight.shape[0], LOGITS_CHUNK)], 1
    )
    assert torch.equal(out, want)
    assert _calls(lambda: _head(hidden, weight, invariant=False), "aten::copy_") == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_gathers_keys_and_values_in_one_op(dtype: torch.dtype) -> None:
    block_size, kv_heads, head_dim, heads, num_blocks = 16, 2, 8, 4, 40
    cache = torch.randn(
        2, num_blocks, block_size, kv_heads, head_dim, generator=torch.Generator().manual_seed(1)
    )
    cache = cache.to(dtype)
    tables = [[2 + 3 * i, 3 + 3 * i] for i in range(6)]
    lens = [block_size + 1 + i for i in range(6)]
    buckets = build_decode_buckets(list(range(6)), tables, lens, block_size=block_size, sliding_window=None,
                                   dtype=dtype, null_block=num_blocks - 1, max_buckets=1)  # fmt: skip
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long), decode_buckets=buckets, prefills=[]
    )
    q = torch.randn(6, heads, head_dim).to(dtype)
    out = attend(q, q[:, :kv_heads], q[:, :kv_heads], cache, meta, scale=0.3)
    for i, (table, n) in enumerate(zip(tables, lens, strict=True)):  # one row alone, its own keys only
        k = cache[0][table].flatten(0, 1)[:n].transpose(0, 1)  # [KVH, n, D]
        v = cache[1][table].flatten(0, 1)[:n].transpose(0, 1)
        qi = q[i].view(kv_heads, heads // kv_heads, head_dim)
        ref = torch.softmax((qi.double() @ k.double().transpose(-1, -2)) * 0.3, -1) @ v.double()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[i].double(), ref.reshape(heads, head_dim), atol=tol, rtol=tol)
    assert len(_calls(lambda: attend(q, q, q, cache, meta, scale=0.3), "aten::index_select")) == 1
