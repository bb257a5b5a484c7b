"""Cost of constrained decoding per constrained row, on bench-small (vocabulary 32000).

    python benchmarks/structured.py --json

The sampler (penalties, grammar masks, draw) on [BATCH, 32000] logits with 0, 1, 8 or all BATCH rows
under a JSON-schema grammar (an unbounded list of small objects, so no row ever ends), tokens fed back
each round as the engine does; the cost per constrained row is (median time with k grammar rows -
median time without) / k, and `mask_ms_per_row` the mask computation alone. `--engine` also steps three
engines on bench-small (0, 8, BATCH grammar rows among BATCH decoding requests), interleaved one step
at a time as benchmarks/lora_overhead.py does, for the whole-step cost. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Timer, bench_model, setup_threads  # noqa: E402

BATCH = 32
PROMPT_LEN = 32
SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
}


def start(engine, grammar, num_constrained: int, num_steps: int) -> None:
    from base_engine import SamplingParams

    for i in range(BATCH):
        constraint = grammar.new_constraint() if i < num_constrained else None
        params = SamplingParams(
            temperature=1.0, seed=i, max_tokens=num_steps + 8, ignore_eos=True, constraint=constraint
        )
        engine.add_request(f"r{i}", [10 + (i * 7 + j) % 1000 for j in range(PROMPT_LEN)], params)
    while any(s.num_output_tokens == 0 for s in engine.requests.values()):
        engine.step()


def sampler_seconds(engine, grammar, num_constrained: int, rounds: int) -> float:
    """Median time of the sampler alone on [BATCH, vocab] logits with `num_constrained` grammar rows."""
    import torch

    from base_engine import SamplingParams
    from base_engine.sampler import Sampler, SamplingRow

    vocab = engine.model_config.vocab_size
    sampler = Sampler(seed=0)
    times = []
    rows = [
        SamplingRow(
            SamplingParams(
                temperature=1.0, constraint=grammar.new_constraint() if i < num_constrained else None
            ),
            [1],
            [],
            None,
        )
        for i in range(BATCH)
    ]
    outputs: list[list[int]] = [[] for _ in range(BATCH)]
    for _ in range(rounds):
        logits = torch.randn(BATCH, vocab)
        for i, r in enumerate(rows):
            r.output_token_ids = outputs[i]
        with Timer() as t:
            out = sampler(logits, rows)
        times.append(t.seconds)
        for i, token in enumerate(out.token_ids):
            outputs[i].append(token)
    return statistics.median(times)


def engine_step_ms(model: Path, grammar, num_steps: int) -> dict[int, float]:
    from base_engine import LLMEngine
    from base_engine.engine_config import EngineConfig

    cases = [0, 8, BATCH]
    config = EngineConfig(max_num_seqs=BATCH, num_kv_blocks=1024, block_size=16, seed=0)
    engines = {k: LLMEngine(model, config=config) for k in cases}
    for k, engine in engines.items():
        start(engine, grammar, k, num_steps)
    times: dict[int, list[float]] = {k: [] for k in cases}
    for step in range(num_steps):
        for k in cases[step % len(cases) :] + cases[: step % len(cases)]:
            with Timer() as t:
                engines[k].step()
            times[k].append(t.seconds)
    return {k: 1000 * statistics.median(v) for k, v in times.items()}


def mask_ms_per_row(grammar, vocab: int, rounds: int) -> float:
    from base_engine.constraints import allowed_tokens

    constraint = grammar.new_constraint()
    times = []
    for _ in range(rounds):
        with Timer() as t:
            allowed = allowed_tokens([constraint], vocab)
        times.append(t.seconds)
        constraint.accept(int(allowed[0].nonzero()[0]))
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line (the default output)")
    parser.add_argument("--rounds", type=int, default=60, help="sampler calls per case")
    parser.add_argument("--engine", action="store_true", help="also time whole engine steps (minutes)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps per engine case")
    args = parser.parse_args()
    threads = setup_threads()

    from base_engine.constraints import GrammarCompiler
    from base_engine.model.tokenizer import load_tokenizer

    cases = [0, 1, 8, BATCH]
    with tempfile.TemporaryDirectory() as tmp:
        model = bench_model("bench-small", Path(tmp))
        from base_engine.model.config import load_model_config

        config = load_model_config(model)
        compiler = GrammarCompiler(load_tokenizer(model), config.vocab_size, config.eos_token_ids)
        with Timer() as compile_time:
            grammar = compiler.compile_json_schema(SCHEMA)

        class _Engine:  # what sampler_seconds needs
            model_config = config

        sampler_ms = {k: 1000 * sampler_seconds(_Engine, grammar, k, args.rounds) for k in cases}
        result = {
            "benchmark": "structured",
            "model": "bench-small",
            "vocab": config.vocab_size,
            "batch": BATCH,
            "threads": threads,
            "compile_ms": round(1000 * compile_time.seconds, 2),
            "mask_ms_per_row": round(mask_ms_per_row(grammar, config.vocab_size, args.rounds), 3),
            "sampler_ms": {str(k): round(v, 3) for k, v in sampler_ms.items()},
            "sampler_ms_per_constrained_row": {
                str(k): round((sampler_ms[k] - sampler_ms[0]) / k, 3) for k in cases if k
            },
        }
        if args.engine:
            step_ms = engine_step_ms(model, grammar, args.steps)
            result["step_ms"] = {str(k): round(v, 2) for k, v in step_ms.items()}
            result["step_ms_per_constrained_row"] = {
                str(k): round((step_ms[k] - step_ms[0]) / k, 3) for k in step_ms if k
            }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
