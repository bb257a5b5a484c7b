"""OpenMP parallel regions per decode step, and their share of the step, quiet and with background load.

    python benchmarks/step_regions.py                          # bench-small, batch 32, fp32 and bf16
    python benchmarks/step_regions.py --model bench-moe --dtype float32 --background-load 1

Each parallel region ends in a join that waits for every thread of the team; on cores shared with
other work one descheduled thread stalls the whole join, so the number of regions per step is what
decides how a step degrades under load. The count is exact: the script re-runs itself with
benchmarks/omp_count.c (built with `cc` into a temp dir) preloaded, which wraps libgomp's
`GOMP_parallel` (the entry of torch's `at::parallel_for` and of oneDNN's GEMMs) and sums the calls
and the wall time inside them. One engine holds `--batch` running requests past their prefills;
`--steps` decode steps are timed quiet, then the same number with `--background-load` busy processes
pinned to this process's cores (benchmarks/background_load.py). One more quiet step runs under a
TorchDispatchMode that reads the counters around every aten op: `regions_by_op` names the ops that
open the regions, with their count and the ms spent inside them. One JSON line per dtype.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import Timer, add_model_arg, bench_model  # noqa: E402

PROMPT_LEN = 32


def build_shim(tmp: Path) -> Path:
    out = tmp / "omp_count.so"
    src = ROOT / "benchmarks" / "omp_count.c"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(out), str(src), "-ldl"], check=True)
    return out


def counters():  # noqa: ANN201 - (regions, ns) reader
    lib = ctypes.CDLL(None)
    lib.omp_count_regions.restype = ctypes.c_ulonglong
    lib.omp_count_ns.restype = ctypes.c_ulonglong
    return lambda: (lib.omp_count_regions(), lib.omp_count_ns())


def timed_steps(engine, steps: int, read) -> dict:  # noqa: ANN001
    seconds, regions, inside = [], [], []
    for _ in range(steps):
        r0, n0 = read()
        with Timer() as t:
            engine.step()
        r1, n1 = read()
        seconds.append(t.seconds)
        regions.append(r1 - r0)
        inside.append((n1 - n0) / 1e9)
    median = statistics.median(seconds)
    return {
        "step_ms": round(median * 1e3, 2),
        "regions_per_step": statistics.median(regions),
        "region_share": round(sum(inside) / sum(seconds), 3),
        "ms_per_region": round(sum(inside) / sum(regions) * 1e3, 4) if sum(regions) else None,
    }


def regions_by_op(engine, read) -> list[tuple[str, int, float]]:  # noqa: ANN001
    """(aten op, parallel regions it opened in one step, ms inside them), most regions first: each op
    of the step runs under a TorchDispatchMode that reads the shim's counters around it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    regions: Counter[str] = Counter()
    inside: Counter[str] = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            r0, n0 = read()
            out = func(*args, **(kwargs or {}))
            r1, n1 = read()
            if r1 > r0:
                regions[str(func.overloadpacket)] += r1 - r0
                inside[str(func.overloadpacket)] += (n1 - n0) / 1e6
            return out

    r0, _ = read()
    with Count():
        engine.step()
    regions["(outside aten ops)"] = read()[0] - r0 - sum(regions.values())
    return [(op, n, round(inside[op], 2)) for op, n in regions.most_common(14)]


def measure(model_dir: Path, dtype: str, args: argparse.Namespace) -> dict:
    from base_engine import EngineConfig, LLMEngine, SamplingParams
    from benchmarks.background_load import BackgroundLoad, read_loadavg

    steps = args.steps
    blocks = args.batch * ((PROMPT_LEN + 3 * steps + 16) // 16 + 2)
    config = EngineConfig(max_num_seqs=args.batch, num_kv_blocks=blocks, num_threads=args.threads)
    engine = LLMEngine(model_dir, dtype=dtype, config=config)
    params = SamplingParams(temperature=0.0, max_tokens=3 * steps + 8, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [10 + (i * 7 + j) % 1000 for j in range(PROMPT_LEN)], params)
    while any(s.num_output_tokens == 0 for s in engine.requests.values()):
        engine.step()
    read = counters()
    top = regions_by_op(engine, read)
    quiet = timed_steps(engine, steps, read)
    with BackgroundLoad(args.background_load, sorted(os.sched_getaffinity(0))):
        loaded = timed_steps(engine, steps, read)
        loadavg = read_loadavg()
    engine.close()
    import torch

    return {
        "benchmark": "step-regions", "model": args.model, "dtype": dtype, "batch": args.batch,
        "threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "quiet": quiet, "loaded": loaded, "background_load": args.background_load,
        "loaded_over_quiet": round(quiet["step_ms"] / loaded["step_ms"], 3),
        "regions_by_op": top, "loadavg": loadavg,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arg(parser)
    parser.add_argument("--dtype", action="append", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed quiet, then loaded")
    parser.add_argument("--background-load", type=int, default=1, metavar="N")
    parser.add_argument("--threads", type=int, default=None, help="[default: the engine's choice]")
    args = parser.parse_args()
    if "omp_count.so" not in os.environ.get("LD_PRELOAD", ""):
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "LD_PRELOAD": str(build_shim(Path(tmp)))}
            raise SystemExit(subprocess.run([sys.executable, *sys.argv], env=env).returncode)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench_model(args.model, Path(tmp))
        for dtype in args.dtype or ["float32", "bfloat16"]:
            print(json.dumps(measure(model_dir, dtype, args)), flush=True)


if __name__ == "__main__":
    main()
