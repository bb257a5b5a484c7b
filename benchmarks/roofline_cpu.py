"""How close the engine's decode step comes to its GEMMs alone (issue #25, "How close to the limit").

    python benchmarks/roofline_cpu.py                                  # bench-small, bfloat16
    python benchmarks/roofline_cpu.py --model smollm2
    python benchmarks/roofline_cpu.py --model bench-small --dtype float32 --adapters 32

An engine holds 32 running requests (prompts of 32 tokens) past their prefills. The bound is the
step's linear layers alone: every GEMM one decode step ran (q/k/v, o, gate/up, down per layer and
the LM head; recorded from a real step by benchmarks/step_split.py), replayed on random inputs of the
same shapes and dtype through the same calls (`nn.Linear` forward, the vocabulary-chunked
`decoder._head`), in the step's order. Plain engine steps and GEMM replays are interleaved one by
one, so load from other work on a shared machine hits both alike; each side's figure is its median.

`bound_fraction` = GEMM-only time / engine step time (target >= 0.6 in bfloat16 on bench-small and
SmolLM2); `step_over_gemm` is its inverse. `split_ms` is the step's time by op from steps run under
timed hooks (StepSplit's categories: gemm, attention, rope, norms, moe, lora, sampler, schedule,
prepare, model, python), with `top_non_gemm` the three largest outside GEMMs. `--adapters N` gives
the 32 rows N distinct random rank-16 adapters (round-robin) on all projections, for the LoRA share.
Prints one JSON line, with the load average at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.background_load import read_loadavg  # noqa: E402
from benchmarks.common import Timer, add_model_arg, bench_model  # noqa: E402
from benchmarks.step_split import StepSplit, gemm_inputs, replay_gemms  # noqa: E402

BATCH = 32
PROMPT_LEN = 32
RANK = 16


def start_engine(model_dir: Path, args: argparse.Namespace, steps: int, tmp: Path):  # noqa: ANN201
    """An LLMEngine with BATCH requests decoding (each past its first token)."""
    from base_engine import EngineConfig, LLMEngine, SamplingParams
    from benchmarks.lora_workload import is_moe, make_lora_adapters, make_peft_moe_adapters

    num_adapters, slots = args.adapters, max(args.adapters, 1)
    config = EngineConfig(max_num_seqs=BATCH, max_loras=slots, max_cpu_loras=slots, max_lora_rank=RANK,
                          num_kv_blocks=BATCH * ((PROMPT_LEN + steps + 8) // 16 + 2),
                          num_threads=args.threads or None)  # fmt: skip
    engine = LLMEngine(model_dir, dtype=args.dtype, config=config)
    refs: list = [None] * BATCH
    if num_adapters:
        make = make_peft_moe_adapters if is_moe(model_dir) else make_lora_adapters
        dirs = make(model_dir, tmp / "adapters", num=num_adapters, rank=RANK)
        refs = [engine.lora.local_ref(dirs[i % num_adapters]) for i in range(BATCH)]
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i, ref in enumerate(refs):
        engine.add_request(f"r{i}", [10 + (i * 7 + j) % 1000 for j in range(PROMPT_LEN)], params, adapter=ref)
    while any(s.num_output_tokens == 0 for s in engine.requests.values()):  # prefills (and adapter loads)
        engine.step()
    return engine


def measure(engine, steps: int, split_steps: int) -> dict:  # noqa: ANN001 - an LLMEngine
    """The split (hooked steps), then plain steps interleaved with GEMM replays."""
    for _ in range(3):  # warm: allocator, first decode buckets
        engine.step()
    with StepSplit(engine) as split:
        hooked = [split.step() for _ in range(split_steps)]
    gemms = split.gemms
    inputs = gemm_inputs(gemms)
    replay_gemms(gemms, inputs)  # warm
    step_s, gemm_s = [], []
    for _ in range(steps):
        with Timer() as t:
            engine.step()
        step_s.append(t.seconds)
        gemm_s.append(replay_gemms(gemms, inputs))
    split_ms = split.per_step_ms()
    non_gemm = sorted(((ms, c) for c, ms in split_ms.items() if c != "gemm"), reverse=True)
    step_ms, gemm_ms = 1000 * statistics.median(step_s), 1000 * statistics.median(gemm_s)
    return {
        "step_ms": round(step_ms, 3), "gemm_only_ms": round(gemm_ms, 3),
        "bound_fraction": round(gemm_ms / step_ms, 3), "step_over_gemm": round(step_ms / gemm_ms, 3),
        "num_gemms": len(gemms), "hooked_step_ms": round(1000 * statistics.median(hooked), 3),
        "split_ms": split_ms, "top_non_gemm": [c for _, c in non_gemm[:3]],
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_arg(parser)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"),
                        help="serving dtype [default: bfloat16]")  # fmt: skip
    parser.add_argument("--steps", type=int, default=40, help="plain steps (and GEMM replays) timed")
    parser.add_argument("--split-steps", type=int, default=15, help="steps timed under the hooks")
    parser.add_argument("--adapters", type=int, default=0, metavar="N",
                        help="N distinct adapters over the 32 rows [default: 0, base model]")  # fmt: skip
    parser.add_argument("--threads", type=int, default=0,
                        help="engine intra-op threads [default: the CPUs this process may use]")  # fmt: skip
    args = parser.parse_args()
    if not 0 <= args.adapters <= BATCH:
        raise SystemExit(f"--adapters must be in [0, {BATCH}], got {args.adapters}")
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench_model(args.model, Path(tmp))
        total = args.steps + args.split_steps + 3
        engine = start_engine(model_dir, args, total, Path(tmp))
        result = {"benchmark": "roofline-cpu", "model": args.model, "dtype": args.dtype, "batch": BATCH,
                  "adapters": args.adapters, "threads": torch.get_num_threads()}  # fmt: skip
        result |= measure(engine, args.steps, args.split_steps)
    result["loadavg"] = read_loadavg()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
