"""Decode tokens/s with int8 base weights vs bfloat16, at batch 1 and batch 32 (target: int8 >= 1.3x).

    python benchmarks/int8_decode.py --model smollm2 --json   # the default served model
    python benchmarks/int8_decode.py --json                   # bench-small

Per batch size, two engines (bf16 weights; int8 weights with bf16 activations, `quantization="int8"`)
hold the same running requests past their prefills; their decode steps are interleaved one by one (the
order rotating every round, as in lora_overhead.py) and each figure is batch / median step time, so a
burst of load from other work on a shared machine hits both alike. Prints one JSON line with the load
average at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_model_arg, bench_model, setup_threads  # noqa: E402
from benchmarks.lora_overhead import interleaved_step_seconds, start_decoding  # noqa: E402

BATCHES = (1, 32)
PROMPT_LEN = 32


def measure(model_dir: Path, batch: int, steps: int) -> dict[str, float]:
    """tok/s of the bf16 and int8 engines at this batch size, steps interleaved."""
    from base_engine import EngineConfig, LLMEngine

    config = dict(max_num_seqs=batch, num_kv_blocks=batch * ((PROMPT_LEN + steps + 8) // 16 + 2))
    engines = {
        "bf16": LLMEngine(model_dir, dtype="bfloat16", config=EngineConfig(**config)),
        "int8": LLMEngine(model_dir, dtype="bfloat16", config=EngineConfig(**config, quantization="int8")),
    }
    for engine in engines.values():
        start_decoding(engine, [None] * batch, steps)
    times = interleaved_step_seconds(engines, steps)
    for engine in engines.values():
        engine.close()
    return {name: batch / statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line (the default output)")
    parser.add_argument("--steps", type=int, default=40, help="decode steps per case")
    add_model_arg(parser)
    args = parser.parse_args()
    threads = setup_threads()
    load_start = os.getloadavg()[0]
    result: dict[str, object] = {"benchmark": "int8-decode", "model": args.model, "threads": threads}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench_model(args.model, Path(tmp))
        for batch in BATCHES:
            tok_s = measure(model_dir, batch, args.steps)
            result[f"bf16_tok_s_b{batch}"] = round(tok_s["bf16"], 2)
            result[f"int8_tok_s_b{batch}"] = round(tok_s["int8"], 2)
            result[f"int8_over_bf16_b{batch}"] = round(tok_s["int8"] / tok_s["bf16"], 3)
    result["loadavg_start_end"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
