"""Decode attention micro-benchmark: one padded group vs length buckets; prints one JSON line.

64 decodes with random contexts 32..384 tokens (bench-small heads: 8 query heads, 4 KV heads of 64;
block size 16; blocks scattered through the pool as the block manager leaves them). Both variants run
in the same process, interleaved call by call, through `base_engine.runner.attention.attend`: "padded" is
the metadata with a single bucket (every row gathered and masked up to the longest context, as the
engine did before buckets), "bucketed" the engine's rule (`plan_decode_buckets`). Times are the median
of one layer's decode attention; `build_ms` is the host-side metadata build, paid once per step.

Usage: python benchmarks/decode_attention.py --json [--repeats 30] [--threads N] [--max-buckets 8]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from base_engine.runner.attention import AttentionMetadata, attend
from base_engine.runner.decode_buckets import MAX_DECODE_BUCKETS, DecodeBucket, build_decode_buckets
from benchmarks.common import setup_threads  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 4, 64, 16


def _workload(num_seqs: int, lo: int, hi: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    seq_lens = [rng.randint(lo, hi) for _ in range(num_seqs)]
    num_blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    pool = list(range(1, sum(num_blocks) + 1))  # block 0 stays the padding block
    rng.shuffle(pool)
    tables, at = [], 0
    for n in num_blocks:
        tables.append(pool[at : at + n])
        at += n
    return tables, seq_lens


def _meta(tables: list[list[int]], seq_lens: list[int], max_buckets: int) -> AttentionMetadata:
    buckets = build_decode_buckets(
        list(range(len(seq_lens))),
        tables,
        seq_lens,
        block_size=BLOCK_SIZE,
        sliding_window=None,
        dtype=torch.float32,
        null_block=0,
        max_buckets=max_buckets,
    )
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long), decode_buckets=buckets, prefills=[]
    )


def _ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def run(num_seqs: int, repeats: int, max_buckets: int, seed: int) -> dict[str, object]:
    tables, seq_lens = _workload(num_seqs, 32, 384, seed)
    num_pool_blocks = sum(len(t) for t in tables) + 1
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(2, num_pool_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    q = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, generator=gen)
    scale = HEAD_DIM**-0.5
    metas = {"padded": _meta(tables, seq_lens, 1), "bucketed": _meta(tables, seq_lens, max_buckets)}
    outs = {name: attend(q, q, q, kv_cache, meta, scale) for name, meta in metas.items()}
    max_abs_diff = (outs["padded"] - outs["bucketed"]).abs().max().item()
    times: dict[str, list[float]] = {name: [] for name in metas}
    build: dict[str, list[float]] = {name: [] for name in metas}
    for _ in range(repeats):  # interleaved: both variants see the same machine load
        for name, meta in metas.items():
            times[name].append(_ms(lambda meta=meta: attend(q, q, q, kv_cache, meta, scale)))
        build["padded"].append(_ms(lambda: _meta(tables, seq_lens, 1)))
        build["bucketed"].append(_ms(lambda: _meta(tables, seq_lens, max_buckets)))
    padded, bucketed = statistics.median(times["padded"]), statistics.median(times["bucketed"])
    buckets: list[DecodeBucket] = metas["bucketed"].decode_buckets
    return {
        "bench": "decode_attention",
        "num_seqs": num_seqs,
        "threads": torch.get_num_threads(),
        "num_buckets": len(buckets),
        "bucket_rows": [len(b.rows) for b in buckets],
        "padded_ms": round(padded, 3),
        "bucketed_ms": round(bucketed, 3),
        "ratio": round(padded / bucketed, 3),
        "build_padded_ms": round(statistics.median(build["padded"]), 3),
        "build_bucketed_ms": round(statistics.median(build["bucketed"]), 3),
        "max_abs_diff": max_abs_diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line (the only output mode)")
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--max-buckets", type=int, default=MAX_DECODE_BUCKETS)
    parser.add_argument("--threads", type=int, default=0, help="0 = the benchmarks' default")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    else:
        setup_threads()
    with torch.inference_mode():
        result = run(args.num_seqs, args.repeats, args.max_buckets, args.seed)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
