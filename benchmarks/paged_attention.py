"""Paged attention: the Triton kernels (kernels/attention) vs the engine's torch path; one JSON line.

Llama-3-8B attention shapes (32 query heads, 8 KV heads of 128, block size 16, bf16), blocks scattered
through the pool as the block manager leaves them. Decode: batch 1 at 4k context, 32 and 64 rows of
mixed contexts; per case the median time of the Triton call (eager, and replayed from a CUDA graph:
the engine's decode path), of `base_engine.runner.attention.attend` with its length buckets (metadata moved to
the device, built outside the timing), the KV bytes read per call and the fraction of the measured copy
bandwidth that is (`decode_bw_fraction`: 32 mixed rows). Prefill: chunks over cached prefixes, TFLOP/s
of the visible (query, key) pairs. Every call starts from caches flushed by a 256 MiB write. Outputs of
both paths are compared (max_abs_diff); an error in one case is reported in its row, not raised.

Usage: python benchmarks/paged_attention.py --json [--repeats 20]
       TRITON_INTERPRET=1 python benchmarks/paged_attention.py --json --smoke   (tiny shapes, CPU)
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.attention import paged_decode_attention, paged_prefill_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DECODE_CASES = (  # (name, rows, shortest, longest context)
    ("b1_ctx4096", 1, 4096, 4096),
    ("b32_mixed", 32, 128, 4096),
    ("b64_mixed", 64, 128, 2048),
)
PREFILL_CASES = (  # (name, [(context, query length)])
    ("4x512_ctx0-3072", [(0, 512), (1024, 512), (2048, 512), (3072, 512)]),
    ("8x128_ctx2048", [(2048, 128)] * 8),
)
SMOKE = dict(
    heads=4, kv_heads=2, head_dim=64, decode=(("b3_mixed", 3, 5, 70),), prefill=(("2x9", [(0, 9), (30, 9)]),)
)


class Timer:
    """Median time of a call on `device`, each call after a cache-flushing write (not timed)."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device, self.repeats = device, repeats
        self.flush = torch.empty((256 << 20) // 4, dtype=torch.float32, device=device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def median_s(self, fn: Callable[[], object]) -> float:
        fn()  # compile / warm up
        times = []
        for _ in range(self.repeats):
            self.flush.zero_()
            self._sync()
            start = time.perf_counter()
            fn()
            self._sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def copy_GBps(self) -> float:
        src = torch.empty(
            (1 << 30) // 4 if self.device.type == "cuda" else (64 << 20) // 4, device=self.device
        )
        dst = torch.empty_like(src)
        seconds = self.median_s(lambda: dst.copy_(src))
        return 2 * src.numel() * 4 / seconds / 1e9


def graph_replay(fn: Callable[[], object], device: torch.device) -> Callable[[], object] | None:
    """fn captured in a CUDA graph (its tensors are then fixed); None off CUDA."""
    if device.type != "cuda":
        return None
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


class Pool:
    """One layer's KV block pool with each sequence's blocks scattered through it."""

    def __init__(self, lengths: list[int], shape: dict, dtype: torch.dtype, device: torch.device, seed: int):
        rng = random.Random(seed)
        counts = [-(-n // BLOCK_SIZE) for n in lengths]
        ids = list(range(1, sum(counts) + 1))  # block 0: the engine's null block (zero)
        rng.shuffle(ids)
        self.tables_list, at = [], 0
        for c in counts:
            self.tables_list.append(ids[at : at + c])
            at += c
        width = max(counts)
        self.tables = torch.tensor([t + [0] * (width - len(t)) for t in self.tables_list], device=device)
        gen = torch.Generator(device=device).manual_seed(seed)
        size = (2, sum(counts) + 1, BLOCK_SIZE, shape["kv_heads"], shape["head_dim"])
        self.cache = torch.randn(size, generator=gen, device=device).to(dtype)
        self.cache[:, 0] = 0


def _engine_decode_meta(pool: Pool, lengths: list[int], dtype: torch.dtype, device: torch.device):
    from base_engine.runner.attention import AttentionMetadata
    from base_engine.runner.decode_buckets import build_decode_buckets

    extra = {"null_block": 0} if "null_block" in inspect.signature(build_decode_buckets).parameters else {}
    buckets = build_decode_buckets(
        list(range(len(lengths))), pool.tables_list, lengths, block_size=BLOCK_SIZE, sliding_window=None,
        dtype=dtype, **extra,
    )  # fmt: skip
    for b in buckets:  # built on the host (as the engine does), then moved
        b.rows, b.block_tables = b.rows.to(device), b.block_tables.to(device)
        b.mask = None if b.mask is None else b.mask.to(device)
    return AttentionMetadata(torch.empty(0, dtype=torch.long, device=device), buckets, [])


def bench_decode(case, shape: dict, dtype, device, timer: Timer, copy_gbps: float, backend: str) -> dict:
    name, rows, shortest, longest = case
    rng = random.Random(rows)
    lengths = [longest] + [rng.randint(shortest, longest) for _ in range(rows - 1)]
    pool = Pool(lengths, shape, dtype, device, seed=rows)
    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(rows, shape["heads"], shape["head_dim"], generator=gen, device=device).to(dtype)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    tables = pool.tables.to(torch.int32)
    scale = shape["head_dim"] ** -0.5
    out = torch.empty_like(q)
    kv_bytes = sum(lengths) * shape["kv_heads"] * shape["head_dim"] * 2 * q.element_size()
    row: dict = {"case": name, "rows": rows, "tokens": sum(lengths), "kv_MB": round(kv_bytes / 1e6, 1)}

    def triton_call() -> None:
        paged_decode_attention(q, pool.cache, tables, seq_lens, scale=scale, out=out,
                               max_seq_len=longest, backend=backend)  # fmt: skip

    seconds = timer.median_s(triton_call)
    row |= {"triton_us": round(seconds * 1e6, 1), "kv_GBps": round(kv_bytes / seconds / 1e9, 1)}
    row["bw_fraction"] = round(kv_bytes / seconds / 1e9 / copy_gbps, 3)
    try:
        replay = graph_replay(triton_call, device)
        if replay is not None:
            graphed = timer.median_s(replay)
            row |= {"triton_graph_us": round(graphed * 1e6, 1)}
            row["graph_bw_fraction"] = round(kv_bytes / graphed / 1e9 / copy_gbps, 3)
    except Exception as exc:  # noqa: BLE001 (reported, the other measurements stand)
        row["graph_error"] = repr(exc)[:300]
    triton_out = out.clone()
    try:
        from base_engine.runner.attention import attend

        meta = _engine_decode_meta(pool, lengths, dtype, device)
        torch_s = timer.median_s(lambda: attend(q, q, q, pool.cache, meta, scale))
        row |= {"torch_us": round(torch_s * 1e6, 1), "speedup": round(torch_s / seconds, 2)}
        diff = attend(q, q, q, pool.cache, meta, scale).float() - triton_out.float()
        row["max_abs_diff"] = float(diff.abs().max())
    except Exception as exc:  # noqa: BLE001
        row["torch_error"] = repr(exc)[:300]
    return row


def bench_prefill(case, shape: dict, dtype, device, timer: Timer, backend: str) -> dict:
    from base_engine.runner.attention import AttentionMetadata, PrefillChunk, chunk_mask, write_kv

    name, chunks = case
    lengths = [c + m for c, m in chunks]
    pool = Pool(lengths, shape, dtype, device, seed=len(chunks))
    total = sum(m for _, m in chunks)
    gen = torch.Generator(device=device).manual_seed(2)
    q = torch.randn(total, shape["heads"], shape["head_dim"], generator=gen, device=device).to(dtype)
    k = torch.randn(total, shape["kv_heads"], shape["head_dim"], generator=gen, device=device).to(dtype)
    v = torch.randn_like(k)
    starts, at = [], 0
    for _, m in chunks:
        starts.append(at)
        at += m
    as_index = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    query_starts, query_lens, seq_lens = as_index(starts), as_index([m for _, m in chunks]), as_index(lengths)
    scale = shape["head_dim"] ** -0.5
    out = torch.empty_like(q)
    pairs = sum(c * m + m * (m + 1) // 2 for c, m in chunks)
    flops = 4 * pairs * shape["heads"] * shape["head_dim"]
    row: dict = {"case": name, "queries": total, "GFLOP": round(flops / 1e9, 2)}

    tables = pool.tables.to(torch.int32)

    def triton_call() -> None:
        paged_prefill_attention(q, k, v, pool.cache, tables, query_starts, query_lens,
                                seq_lens, scale=scale, max_query_len=max(m for _, m in chunks), out=out,
                                backend=backend)  # fmt: skip

    seconds = timer.median_s(triton_call)
    row |= {"triton_us": round(seconds * 1e6, 1), "triton_TFLOPs": round(flops / seconds / 1e12, 1)}
    triton_out = out.clone()
    try:
        prefills, slots = [], []
        for n, ((ctx, m), start) in enumerate(zip(chunks, starts, strict=True)):
            table = pool.tables[n, : -(-(ctx + m) // BLOCK_SIZE)]
            prefills.append(PrefillChunk(start, m, ctx, table, _on(chunk_mask(ctx, m, None), device)))
            slots += [
                pool.tables_list[n][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                for p in range(ctx, ctx + m)
            ]
        write_kv(pool.cache, k, v, torch.tensor(slots, device=device))  # the engine writes, then attends
        meta = AttentionMetadata(torch.empty(0, dtype=torch.long, device=device), [], prefills)
        torch_s = timer.median_s(lambda: _engine_attend(q, k, v, pool.cache, meta, scale))
        row |= {"torch_us": round(torch_s * 1e6, 1), "speedup": round(torch_s / seconds, 2)}
        diff = _engine_attend(q, k, v, pool.cache, meta, scale).float() - triton_out.float()
        row["max_abs_diff"] = float(diff.abs().max())
    except Exception as exc:  # noqa: BLE001
        row["torch_error"] = repr(exc)[:300]
    return row


def _on(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def _engine_attend(q, k, v, cache, meta, scale):
    from base_engine.runner.attention import attend

    return attend(q, k, v, cache, meta, scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line (the only output format)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, for a CPU run of this script")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.smoke:
        shape, decode_cases, prefill_cases = SMOKE, SMOKE["decode"], SMOKE["prefill"]
        repeats = min(args.repeats, 2)
    else:
        shape = dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM)
        decode_cases, prefill_cases, repeats = DECODE_CASES, PREFILL_CASES, args.repeats
    from kernels.attention.api import _triton_interprets

    backend = "triton" if cuda or _triton_interprets() else "torch"
    timer = Timer(device, repeats)
    copy_gbps = timer.copy_GBps()
    report: dict = {
        "bench": "paged_attention",
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "backend": backend,
        "dtype": str(dtype).removeprefix("torch."),
        "shape": {k: shape[k] for k in ("heads", "kv_heads", "head_dim")} | {"block_size": BLOCK_SIZE},
        "copy_GBps": round(copy_gbps, 1),
    }
    with torch.inference_mode():
        report["decode"] = [
            bench_decode(c, shape, dtype, device, timer, copy_gbps, backend) for c in decode_cases
        ]
        report["prefill"] = [bench_prefill(c, shape, dtype, device, timer, backend) for c in prefill_cases]
    main_case = next((r for r in report["decode"] if r["case"] == "b32_mixed"), report["decode"][0])
    report["decode_bw_fraction"] = main_case.get("graph_bw_fraction", main_case["bw_fraction"])
    print(json.dumps(report))


if __name__ == "__main__":
    main()
