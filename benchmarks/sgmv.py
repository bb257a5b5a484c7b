"""SGMV add_lora benchmark at Llama-3-8B projection shapes; prints one JSON line.

For each backend (the torch twin on CPU; Triton too when CUDA is present), projection (qkv, gate_up,
down), token count T in {1, 8, 32, 128} and adapter mix (1 adapter for all rows / T distinct adapters):
the median time of one `add_lora` call with a prebuilt meta (as the engine calls it), and the bytes it
must move by the formula of Punica's roofline (../shared/reference/kernels.md section 5.2), summed over
slices: b * (n r (h_in + h_out) + T (h_in + 2 h_out + 2 r)). The machine's own bandwidth is measured in
the same run: a large tensor copy (bytes read + written) timed just before every measured call.
`distinct_bw_fraction` is achieved / measured bandwidth at T=32 with 32 distinct adapters, over the three
projections together (target >= 0.5).

Usage: python benchmarks/sgmv.py --json [--backends torch,triton] [--repeats 7] [--threads N]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.sgmv import add_lora, build_meta  # noqa: E402
from kernels.sgmv.layout import alloc_stacks  # noqa: E402

RANK = 16
TOKEN_COUNTS = (1, 8, 32, 128)
# name -> (H_in, output slices): Llama-3-8B, GQA 32 q heads / 8 kv heads of 128, MLP 14336
PROJECTIONS = {
    "qkv": (4096, (4096, 1024, 1024)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}
TARGET_FRACTION = 0.5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


class Bandwidth:
    """A large device-local copy, timed right before each measured call.

    Interleaving keeps the ratio honest on a shared, noisy machine (both see the same load), and the
    copy evicts the caches, so every call reads its adapter weights from memory as a real step would.
    Bandwidth counts the bytes read and the bytes written (STREAM 'copy').
    """

    def __init__(self, device: torch.device, num_bytes: int, threads: int) -> None:
        self.device = device
        self.threads = threads  # the copy always gets every core: it stands for the machine
        self.src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).uniform_()
        self.dst = torch.empty_like(self.src)
        self.flush_elems = min(self.src.numel(), (256 << 20) // 4)  # > any L2/L3 here
        self.samples: list[float] = []

    def sample(self) -> float:
        call_threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        seconds = _seconds(lambda: self.dst.copy_(self.src), self.device)
        torch.set_num_threads(call_threads)
        self.samples.append(2 * self.src.numel() * 4 / seconds)
        # read (not write) a cache's worth of memory: the copy's dirty lines get written back now,
        # not during the measured call, which then starts from clean, cold caches
        self.src[: self.flush_elems].sum()
        _sync(self.device)
        return self.samples[-1]


def measure(fn: Callable[[], object], bandwidth: Bandwidth, repeats: int) -> tuple[float, float]:
    """(median seconds of fn, median copy bandwidth interleaved with it); the first call warms up."""
    fn()  # Triton compiles here
    times, rates = [], []
    for _ in range(repeats):
        rates.append(bandwidth.sample())
        times.append(_seconds(fn, bandwidth.device))
    return statistics.median(times), statistics.median(rates)


def model_bytes(h_in: int, outs: tuple[int, ...], num_tokens: int, num_adapters: int, elem: int) -> int:
    return sum(
        elem * (num_adapters * RANK * (h_in + h) + num_tokens * (h_in + 2 * h + 2 * RANK)) for h in outs
    )


def bench_projection(
    backend: str, name: str, device: torch.device, dtype: torch.dtype, bandwidth: Bandwidth, repeats: int
) -> list[dict]:
    h_in, outs = PROJECTIONS[name]
    num_slots = max(TOKEN_COUNTS)
    gen = torch.Generator(device=device).manual_seed(0)
    # the engine's slot-pool layout for this device (on CPU: the A factors of all slices interleaved)
    lora_a, lora_b = alloc_stacks(num_slots, RANK, h_in, outs, dtype=dtype, device=device)
    for w in (*lora_a, *lora_b):
        w.copy_(torch.randn(w.shape, generator=gen, device=device, dtype=dtype))
    scales = torch.full((num_slots,), 0.5, device=device)
    rows = []
    for num_tokens in TOKEN_COUNTS:
        x = torch.randn(num_tokens, h_in, generator=gen, device=device, dtype=dtype) / h_in**0.5
        y = torch.zeros(num_tokens, sum(outs), device=device, dtype=dtype)
        perm = torch.randperm(num_slots, generator=gen, device=device)
        for mode, slots in (("identical", perm[:1].repeat(num_tokens)), ("distinct", perm[:num_tokens])):
            meta = build_meta(slots, num_slots)  # once per step in the engine, so outside the timing
            call = functools.partial(
                add_lora, y, x, lora_a, lora_b, slots, scales=scales, meta=meta, backend=backend
            )
            seconds, rate = measure(call, bandwidth, repeats)
            adapters = 1 if mode == "identical" else num_tokens
            num_bytes = model_bytes(h_in, outs, num_tokens, adapters, x.element_size())
            us = round(seconds * 1e6, 1)
            gbps = round(num_bytes / seconds / 1e9, 2)
            rows.append(
                dict(
                    proj=name,
                    T=num_tokens,
                    mode=mode,
                    us=us,
                    bytes=num_bytes,
                    GBps=gbps,
                    copy_GBps=rate / 1e9,
                )
            )
    return rows


def summarize(rows: list[dict], bandwidth: Bandwidth) -> dict:
    ratios = {}
    for r in rows:
        if r["mode"] == "distinct":
            same = next(
                o for o in rows if o["proj"] == r["proj"] and o["T"] == r["T"] and o["mode"] == "identical"
            )
            ratios[f"{r['proj']}/T{r['T']}"] = round(r["us"] / same["us"], 2)
    at32 = [r for r in rows if r["T"] == 32 and r["mode"] == "distinct"]
    achieved = sum(r["bytes"] for r in at32) / (sum(r["us"] for r in at32) / 1e6)
    copy_at32 = statistics.median(r["copy_GBps"] for r in at32) * 1e9
    return {
        "copy_GBps": round(statistics.median(bandwidth.samples) / 1e9, 2),
        "distinct_over_identical_time": ratios,
        "distinct_GBps_T32": round(achieved / 1e9, 2),
        "copy_GBps_T32": round(copy_at32 / 1e9, 2),
        "distinct_bw_fraction": round(achieved / copy_at32, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line (the only output format)")
    parser.add_argument("--backends", default="", help="comma list; default torch, plus triton on CUDA")
    parser.add_argument("--repeats", type=int, default=7)
    # Every core by default, as the copy that stands for the machine's bandwidth: on CPU the twin is a few
    # large embedding_bag calls per projection (bag schedule), which OpenMP splits over the batch rows.
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads for add_lora; 0: torch's")
    args = parser.parse_args()
    copy_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    backends = args.backends.split(",") if args.backends else (["torch", "triton"] if cuda else ["torch"])
    report: dict = {
        "bench": "sgmv",
        "rank": RANK,
        "threads": torch.get_num_threads(),
        "copy_threads": copy_threads,
    }
    for backend in backends:
        device = torch.device("cuda" if backend == "triton" else "cpu")
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        bandwidth = Bandwidth(device, (2 << 30) if device.type == "cuda" else (256 << 20), copy_threads)
        rows = [
            r
            for name in PROJECTIONS
            for r in bench_projection(backend, name, device, dtype, bandwidth, args.repeats)
        ]
        report[backend] = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": str(dtype).removeprefix("torch."),
            **summarize(rows, bandwidth),
            "rows": [{k: v for k, v in r.items() if k in ("proj", "T", "mode", "us", "GBps")} for r in rows],
        }
        del bandwidth
    fraction = report.get("torch", {}).get("distinct_bw_fraction")
    report |= {"distinct_bw_fraction": fraction, "target": TARGET_FRACTION}
    report["pass"] = fraction is not None and fraction >= TARGET_FRACTION
    print(json.dumps(report, separators=(",", ":")))


if __name__ == "__main__":
    main()
