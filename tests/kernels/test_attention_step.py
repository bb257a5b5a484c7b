"""A whole engine step through `paged_attention` (decodes and prefill chunks interleaved in one
flattened batch, metadata from `build_paged_meta`) against the engine's torch path
(`base_engine.runner.attention.attend` on the metadata the engine builds), with the Triton kernels under the
interpreter and with the twin. Free blocks of the pool hold NaN, as after a poisoned free.
"""

from __future__ import annotations

import inspect
import os
import random

import pytest
import torch

from kernels.attention import build_paged_meta, paged_attention
from tests.kernels.attention_oracle import one_thread

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

BS, KVH, GROUP, D = 16, 2, 2, 64


def _step(window: int | None, seed: int):
    """Rows: decode, chunk (context 21, 7 new), decode, decode, first chunk (5 new), decode."""
    from base_engine.runner.attention import AttentionMetadata, PrefillChunk, chunk_mask, write_kv
    from base_engine.runner.decode_buckets import build_decode_buckets

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    layout = [("d", 40), ("p", (21, 7)), ("d", 1), ("d", 16), ("p", (0, 5)), ("d", 77)]
    counts = [-(-(n if kind == "d" else n[0] + n[1]) // BS) for kind, n in layout]
    pool_size = sum(counts) + 4
    ids = list(range(1, pool_size))  # block 0: the zero null block
    rng.shuffle(ids)
    cache = torch.full((2, pool_size, BS, KVH, D), float("nan"))
    cache[:, 0] = 0
    tables, at = [], 0
    for c in counts:
        tables.append(ids[at : at + c])
        at += c
    for table in tables:  # every owned block written with finite values
        cache[:, table] = torch.randn(2, len(table), BS, KVH, D, generator=gen)
    num_rows = sum(1 if kind == "d" else n[1] for kind, n in layout)
    q = torch.randn(num_rows, KVH * GROUP, D, generator=gen)
    k = torch.randn(num_rows, KVH, D, generator=gen)
    v = torch.randn(num_rows, KVH, D, generator=gen)
    dec, pre, slots, row = {"rows": [], "tables": [], "lens": []}, [], [], 0
    for (kind, n), table in zip(layout, tables, strict=True):
        if kind == "d":  # the new token at position n - 1, written before attention
            dec["rows"].append(row)
            dec["tables"].append(table)
            dec["lens"].append(n)
            slots.append(table[(n - 1) // BS] * BS + (n - 1) % BS)
            row += 1
        else:
            ctx, m = n
            pre.append((row, m, ctx + m, table))
            slots += [table[p // BS] * BS + p % BS for p in range(ctx, ctx + m)]
            row += m
    slot_mapping = torch.tensor(slots)
    write_kv(cache, k, v, slot_mapping)
    extra = {"null_block": 0} if "null_block" in inspect.signature(build_decode_buckets).parameters else {}
    buckets = build_decode_buckets(
        dec["rows"], dec["tables"], dec["lens"], block_size=BS, sliding_window=window, dtype=torch.float32,
        **extra,
    )  # fmt: skip
    chunks = [
        PrefillChunk(start, m, seq_len - m, torch.tensor(table[: -(-seq_len // BS)]),
                     chunk_mask(seq_len - m, m, window))
        for start, m, seq_len, table in pre
    ]  # fmt: skip
    engine_meta = AttentionMetadata(slot_mapping, buckets, chunks)
    meta = build_paged_meta(
        block_size=BS, device="cpu", decode_seq_lens=dec["lens"], decode_tables=dec["tables"],
        decode_rows=dec["rows"], prefill_query_starts=[p[0] for p in pre],
        prefill_query_lens=[p[1] for p in pre], prefill_seq_lens=[p[2] for p in pre],
        prefill_tables=[p[3] for p in pre], sliding_window=window,
    )  # fmt: skip
    return q, k, v, cache, engine_meta, meta


@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_step_matches_engine_torch_path(backend: str, window: int | None) -> None:
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    from base_engine.runner.attention import attend

    q, k, v, cache, engine_meta, meta = _step(window, seed=21)
    want = attend(q, k, v, cache, engine_meta, D**-0.5)
    got = paged_attention(q, k, v, cache, meta, scale=D**-0.5, backend=backend)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() < 1e-5


def test_build_paged_meta_running_example() -> None:
    meta = build_paged_meta(
        block_size=4, device="cpu", decode_seq_lens=[6, 9], decode_tables=[[7, 2, 99], [3, 5, 8]],
        decode_rows=[0, 4], prefill_query_starts=[1], prefill_query_lens=[3], prefill_seq_lens=[5],
        prefill_tables=[[4, 6, 11]],
    )  # fmt: skip
    assert meta.decode_rows.tolist() == [0, 4]
    assert meta.decode_seq_lens.tolist() == [6, 9]
    assert meta.decode_block_tables.tolist() == [[7, 2, 0], [3, 5, 8]]
    assert meta.prefill_block_tables.tolist() == [[4, 6]]
    assert (meta.prefill_query_starts.tolist(), meta.prefill_query_lens.tolist()) == ([1], [3])
    assert (meta.max_query_len, meta.max_decode_len, meta.num_decodes, meta.num_prefills) == (3, 9, 2, 1)
    assert meta.decode_seq_lens.dtype == torch.int32


def test_build_paged_meta_pads_for_a_captured_graph() -> None:
    static = build_paged_meta(
        block_size=4, device="cpu", decode_seq_lens=[6], decode_tables=[[7, 2]], pad_decodes_to=4,
        decode_table_width=8, pad_block=0, num_splits=2,
    )  # fmt: skip
    assert static.decode_rows is None and static.num_decodes == 4
    assert static.decode_seq_lens.tolist() == [6, 0, 0, 0]
    assert tuple(static.decode_block_tables.shape) == (4, 8)
    assert static.prefill_block_tables.shape[0] == 0
    # next step: three decodes, copied into the captured buffers
    step = build_paged_meta(
        block_size=4, device="cpu", decode_seq_lens=[9, 1, 30],
        decode_tables=[[1, 2, 3], [4], list(range(8))], pad_decodes_to=4, decode_table_width=8, num_splits=2,
    )  # fmt: skip
    tables = static.decode_block_tables
    static.copy_(step)
    assert static.decode_block_tables is tables
    assert static.decode_seq_lens.tolist() == [9, 1, 30, 0]
    assert static.decode_block_tables[2].tolist() == list(range(8))
    with pytest.raises(ValueError, match="layouts differ"):
        other = build_paged_meta(block_size=4, device="cpu", decode_seq_lens=[9], decode_tables=[[1, 2, 3]],
                                 pad_decodes_to=2, decode_table_width=8, num_splits=2)  # fmt: skip
        static.copy_(other)
    with pytest.raises(ValueError, match="num_splits"):
        build_paged_meta(
            block_size=4, device="cpu", decode_seq_lens=[6], decode_tables=[[7, 2]], pad_decodes_to=4
        )
    with pytest.raises(ValueError):
        build_paged_meta(block_size=4, device="cpu", decode_seq_lens=[9], decode_tables=[[1, 2]])
    with pytest.raises(ValueError):
        build_paged_meta(block_size=4, device="cpu", decode_seq_lens=[6, 2], decode_tables=[[1, 2], [3]],
                         pad_decodes_to=1)  # fmt: skip


def test_graph_padded_step_gives_zeros_on_padding_rows() -> None:
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(2, 8, BS, KVH, D, generator=gen)
    q = torch.randn(4, KVH * GROUP, D, generator=gen)
    meta = build_paged_meta(block_size=BS, device="cpu", decode_seq_lens=[20, 3], decode_tables=[[3, 5], [6]],
                            pad_decodes_to=4, decode_table_width=4, num_splits=1)  # fmt: skip
    out = paged_attention(q, q, q, cache, meta, scale=D**-0.5, backend="torch")
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert torch.isfinite(out[:2]).all() and out[:2].abs().sum() > 0
