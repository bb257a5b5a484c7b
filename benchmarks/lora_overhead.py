"""Decode throughput at batch 32 on bench-small: no adapter, one shared adapter, 32 distinct adapters.

    python benchmarks/lora_overhead.py --json

All three runs use the same engine configuration and prompts; only decode steps are timed (after every
request has finished its prefill). Targets: one_over_base >= 0.85, distinct_over_base >= 0.70. Prints
the bytes read per decode step (base weights + the distinct adapters' factors) with each figure.
The three cases are interleaved for --rounds rounds and each case's best round is kept.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Timer, bench_small, setup_threads  # noqa: E402
from benchmarks.lora_workload import make_lora_adapters  # noqa: E402

BATCH = 32
PROMPT_LEN = 32


def decode_tok_s(engine, refs: list, num_steps: int) -> float:
    from base_engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 8, ignore_eos=True)
    for i, ref in enumerate(refs):
        engine.add_request(f"r{i}", [10 + (i * 7 + j) % 1000 for j in range(PROMPT_LEN)], params, adapter=ref)
    while any(s.num_output_tokens == 0 for s in engine.requests.values()):  # prefills (and adapter loads)
        engine.step()
    with Timer() as t:
        for _ in range(num_steps):
            engine.step()
    for rid in list(engine.requests):
        engine.abort(rid)
    return BATCH * num_steps / t.seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line (the default output)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument(
        "--rounds", type=int, default=5
    )  # decode runs are short; best of 5 rides out load bursts
    args = parser.parse_args()
    threads = setup_threads()
    from base_engine import EngineConfig, LLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench_small(Path(tmp))
        dirs = make_lora_adapters(model_dir, Path(tmp) / "adapters", num=BATCH, rank=16)
        config = EngineConfig(max_num_seqs=BATCH, max_loras=BATCH, max_cpu_loras=BATCH, max_lora_rank=16)
        engine = LLMEngine(model_dir, config=config)
        refs = [engine.lora.local_ref(d) for d in dirs]
        cases = {"base": [None] * BATCH, "one": [refs[0]] * BATCH, "distinct": refs}
        best = {name: 0.0 for name in cases}
        for _ in range(args.rounds):
            for name, case_refs in cases.items():
                best[name] = max(best[name], decode_tok_s(engine, case_refs, args.steps))
        cfg = engine.model_config
        base_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
        base_bytes -= (
            cfg.vocab_size * cfg.hidden_size * 4 * (0 if cfg.tie_word_embeddings else 1)
        )  # embedding rows
        adapter_bytes = sum((d / "adapter_model.safetensors").stat().st_size for d in dirs)
    result = {
        "benchmark": "lora-overhead", "model": "bench-small", "batch": BATCH, "rank": 16, "threads": threads,
        "base_tok_s": round(best["base"], 2), "one_tok_s": round(best["one"], 2),
        "distinct_tok_s": round(best["distinct"], 2),
        "one_over_base": round(best["one"] / best["base"], 3),
        "distinct_over_base": round(best["distinct"] / best["base"], 3),
        "bytes_per_step_base": base_bytes, "bytes_per_step_one": base_bytes + adapter_bytes // BATCH,
        "bytes_per_step_distinct": base_bytes + adapter_bytes,
    }  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
