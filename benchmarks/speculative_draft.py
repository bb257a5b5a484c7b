"""Draft-model speculation: decode tokens/s with vs without it, and acceptance, in the same run.

    python benchmarks/speculative_draft.py --model smollm2 --json

No pair of real models sharing a tokenizer is on hand: the target drafts for itself (greedy
acceptance about 1: the bound on what a perfect drafter gives, paying a drafter as big as the
target) and a tiny random drafter with the target's tokenizer (acceptance about 0: the worst case).
Greedy chat-like requests (random prompts, little copying), batch 1 and 4. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Timer, add_model_arg, bench_model, model_vocab, setup_threads  # noqa: E402


def tiny_drafter(target: Path, root: Path) -> Path:
    """A 1-layer random model with the target's vocab size and tokenizer files."""
    from base_engine.model.config import load_model_config
    from base_engine.testing.checkpoint import save_random_checkpoint

    config = load_model_config(target)
    path = save_random_checkpoint(
        root / "tiny-drafter", hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=128, vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
    )  # fmt: skip
    for name in os.listdir(target):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(target / name, path / name)
    return path


def run(target: Path, speculative: str | None, batch: int, args) -> dict:  # noqa: ANN001
    from base_engine import LLM, SamplingParams

    rng = random.Random(0)
    vocab = model_vocab(target)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    opts = {} if speculative is None else {"speculative": speculative, "num_speculative_tokens": args.k}
    with LLM(target, max_model_len=1024, **opts) as llm:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
        with Timer() as t:
            outs = llm.generate(prompts, params)
        spec = llm.engine.speculator
        stats = None if spec is None else spec.stats
    tokens = sum(len(o.token_ids) for o in outs)
    row = {"tok_s": round(tokens / t.seconds, 2)}
    if stats is not None:
        drafted, accepted = sum(stats.num_draft_tokens.values()), sum(stats.num_accepted_tokens.values())
        row["acceptance"] = round(accepted / drafted, 3) if drafted else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_arg(parser)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    threads = setup_threads()
    root = Path(tempfile.mkdtemp(prefix="spec-draft-"))
    target = bench_model(args.model, root)
    drafters = {"self": target, "tiny_random": tiny_drafter(target, root)}
    result: dict = {"bench": "speculative_draft", "model": args.model, "k": args.k, "threads": threads}
    for batch in (1, 4):
        base = run(target, None, batch, args)
        result[f"b{batch}_off_tok_s"] = base["tok_s"]
        for name, path in drafters.items():
            row = run(target, f"draft:{path}", batch, args)
            result[f"b{batch}_{name}_tok_s"] = row["tok_s"]
            result[f"b{batch}_{name}_acceptance"] = row["acceptance"]
            result[f"b{batch}_{name}_ratio"] = round(row["tok_s"] / base["tok_s"], 3)
    result["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
