"""The paged attention kernels compiled for a real CUDA GPU (skipped without one; run by
benchmarks/gpu_check.sh): model shapes (Llama-3-8B 32/8 heads, Qwen2-7B groups of 7, Llama-2 MHA,
Mistral-like windows) and contexts up to 6k against the float64 oracle (computed on the GPU), with
every unreadable slot poisoned; no host sync in a call; CUDA-graph replay with other lengths, tables
and padding rows than at capture is bit-identical to eager.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels.attention import (
    build_paged_meta,
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
)
from tests.kernels.attention_cases import decode_case, mixed_lengths, prefill_case
from tests.kernels.attention_oracle import case_id, check_decode, check_prefill

pytestmark = pytest.mark.gpu

HEADS = {  # model -> KV heads, GQA group, head_dim
    "llama3": {"num_kv_heads": 8, "group": 4, "head_dim": 128},  # Llama-3-8B: 32 / 8 heads
    "qwen2": {"num_kv_heads": 4, "group": 7, "head_dim": 128},  # Qwen2-7B: 28 / 4 heads
    "mha": {"num_kv_heads": 32, "group": 1, "head_dim": 128},  # Llama-2-7B
    "small": {"num_kv_heads": 2, "group": 2, "head_dim": 64},
}
LLAMA3 = HEADS["llama3"]
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DECODE_KEYS = ("model", "dtype", "block_size", "window", "batch", "longest", "splits")
DECODE = [
    dict(zip(DECODE_KEYS, values, strict=True))
    for values in (
        ("llama3", BF16, 16, None, 32, 4096, None),  # splits None: the default for the batch shape
        ("llama3", FP16, 32, None, 64, 2048, 1),
        ("llama3", BF16, 16, 4096, 4, 6000, None),  # Mistral-like window, contexts past it
        ("qwen2", BF16, 16, 1000, 16, 3000, 8),
        ("mha", FP32, 16, None, 8, 1500, None),
        ("small", BF16, 32, None, 1, 4096, 16),
    )
]
PREFILL = [  # chunks: (context length, query length)
    {"model": "llama3", "dtype": BF16, "block_size": 16, "window": None,
     "chunks": [(0, 512), (1536, 256), (300, 1), (4000, 96)]},
    {"model": "qwen2", "dtype": FP16, "block_size": 32, "window": 1024, "chunks": [(2000, 300), (0, 77)]},
    {"model": "mha", "dtype": FP32, "block_size": 16, "window": None, "chunks": [(100, 64), (0, 130)]},
    {"model": "small", "dtype": BF16, "block_size": 32, "window": 64, "chunks": [(200, 150), (31, 17)]},
]  # fmt: skip


@pytest.mark.parametrize("cfg", DECODE, ids=[case_id(c) for c in DECODE])
def test_decode_kernel_at_model_shapes(cfg: dict) -> None:
    rng = random.Random(cfg["batch"])
    lengths = mixed_lengths(cfg["batch"], cfg["block_size"], longest=cfg["longest"], rng=rng)
    case = decode_case(
        lengths, block_size=cfg["block_size"], dtype=cfg["dtype"], window=cfg["window"],
        with_rows=cfg["batch"] % 2 == 0, seed=cfg["batch"], device="cuda", **HEADS[cfg["model"]],
    )  # fmt: skip
    check_decode(case, "triton", num_splits=cfg["splits"], max_seq_len=max(lengths))


@pytest.mark.parametrize("cfg", PREFILL, ids=[case_id(c) for c in PREFILL])
def test_prefill_kernel_at_model_shapes(cfg: dict) -> None:
    case = prefill_case(
        cfg["chunks"], block_size=cfg["block_size"], dtype=cfg["dtype"], window=cfg["window"], seed=3,
        device="cuda", **HEADS[cfg["model"]],
    )  # fmt: skip
    check_prefill(case, "triton", max_query_len=max(m for _, m in cfg["chunks"]))


def test_calls_with_host_sizes_never_sync() -> None:
    dec = decode_case([700, 33, 0, 2048], dtype=BF16, device="cuda", seed=4, **LLAMA3)
    pre = prefill_case([(300, 64), (0, 40)], dtype=BF16, device="cuda", seed=5, **LLAMA3)

    def both() -> None:
        paged_decode_attention(dec.q, dec.pool.poisoned, dec.pool.block_tables, dec.seq_lens,
                               scale=dec.scale, num_splits=4)  # fmt: skip
        paged_prefill_attention(pre.q, pre.k, pre.v, pre.pool.poisoned, pre.pool.block_tables,
                                pre.query_starts, pre.query_lens, pre.seq_lens, scale=pre.scale,
                                max_query_len=64)  # fmt: skip

    both()  # compiles outside the guarded region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        both()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("window", [None, 512])
def test_graph_replay_with_other_lengths_and_tables_matches_eager(window: int | None) -> None:
    """Captured once for a batch of 8 (4 splits); replayed with new lengths (0 = padding row), tables
    and queries copied into the captured buffers; every replay equals an eager call bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    num_blocks, bs, width, batch = 1024, 16, 256, 8
    kv_cache = torch.randn(2, num_blocks, bs, 8, 128, device="cuda", generator=gen).to(BF16)
    q = torch.zeros(batch, 32, 128, device="cuda", dtype=BF16)
    tables = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(batch, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    kwargs = dict(scale=128**-0.5, sliding_window=window, num_splits=4)

    def call() -> None:
        paged_decode_attention(q, kv_cache, tables, seq_lens, out=out, **kwargs)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for step in range(3):
        q.copy_(torch.randn(q.shape, device="cuda", generator=gen))
        tables.copy_(torch.randint(0, num_blocks, tables.shape, device="cuda", generator=gen))
        lens = torch.randint(0, width * bs + 1, (batch,), device="cuda", generator=gen)
        lens[step] = 0  # a padding row
        seq_lens.copy_(lens)
        graph.replay()
        eager = paged_decode_attention(q, kv_cache, tables, seq_lens, **kwargs)
        assert torch.equal(out, eager), f"replay {step} differs from eager"
        assert torch.equal(out[step], torch.zeros_like(out[step]))


def test_graph_replay_through_paged_attention_meta_copy() -> None:
    """The documented graph workflow: a static meta captured once (pad to 8 decodes, fixed table width
    and splits); each step builds its meta in pinned host memory and `static.copy_` refreshes it."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    rng = random.Random(7)
    num_blocks, bs, width, batch = 512, 16, 64, 8
    cache = torch.randn(2, num_blocks, bs, 8, 128, device="cuda", generator=gen).to(BF16)
    q = torch.zeros(batch, 32, 128, device="cuda", dtype=BF16)
    out = torch.empty_like(q)
    shape = dict(block_size=bs, pad_decodes_to=batch, decode_table_width=width, num_splits=2)

    def step_meta(device: str, lens: list[int], tables: list[list[int]]):
        return build_paged_meta(device=device, decode_seq_lens=lens, decode_tables=tables,
                                pin_memory=device == "cpu", **shape)  # fmt: skip

    static = step_meta("cuda", [5], [[1]])
    call = lambda: paged_attention(q, q, q, cache, static, scale=128**-0.5, out=out)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for num in (3, 8, 1):
        lens = [rng.randint(1, width * bs) for _ in range(num)]
        tables = [[rng.randrange(num_blocks) for _ in range(width)] for _ in range(num)]
        q.copy_(torch.randn(q.shape, device="cuda", generator=gen))
        static.copy_(step_meta("cpu", lens, tables))
        graph.replay()
        eager = paged_attention(q, q, q, cache, step_meta("cuda", lens, tables), scale=128**-0.5)
        assert torch.equal(out, eager), f"{num} decodes: replay differs from eager"
        assert torch.equal(out[num:], torch.zeros_like(out[num:]))
