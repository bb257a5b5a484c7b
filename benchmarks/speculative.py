"""Speculative decoding: output tokens/s with vs without it, and acceptance per adapter, in the same run.

    python benchmarks/speculative.py --model smollm2 --json [--workloads chat --batches 1 --methods ngram]

Two workloads of chat-templated text prompts, greedy, half the requests through one random adapter
(small weights: it bends the model without breaking it) and half on the base, at batch 1 (requests
one at a time) and batch 4:
- extraction: "repeat / fix this text" prompts, whose outputs mostly copy spans of the prompt (where
  n-gram prompt lookup pays);
- chat: open questions (little copying).
Methods: n-gram on both workloads; on chat also a draft model. No pair of real models sharing a
tokenizer is on hand, so the target drafts for itself (acceptance about 1: the bound a perfect drafter
gives, paying a drafter as big as the target) and a tiny random model with the target's tokenizer
drafts too (acceptance about 0: the worst case, which adaptive k must hold near 1x).
Each figure: output tokens / wall seconds of `LLM.generate` (prefill included), best of --repeats;
the baseline is the same engine with the same requests opted out (`speculative=False`), alternated
with the speculated runs so load drift hits both. Tokens are identical with and without speculation
(checked here too: a mismatch fails the run). One JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Timer, add_model_arg, bench_model, setup_threads  # noqa: E402

logger = logging.getLogger("benchmarks.speculative")
ADAPTER = "bench-adapter"
TEXTS = [
    "The quarterly report shows that revenue grew by twelve percent, driven mainly by strong sales in "
    "the northern region. Operating costs stayed flat, while marketing spend rose slightly. The board "
    "expects similar growth next quarter if supply chains remain stable.",
    "To reset your password, open the settings page, click on the security tab and choose the option "
    "to change your password. You will receive an email with a link that stays valid for one hour. "
    "Follow the link and enter your new password twice.",
    "The river flows through the old town, past the market square and under seven stone bridges. In "
    "summer the banks fill with people who swim, read and eat ice cream, and in winter the water "
    "sometimes freezes so hard that children skate on it.",
    "Our meeting is moved from Tuesday to Thursday at ten in the morning. Please bring the updated "
    "budget sheets and the list of open questions from the last review. Lunch will be served after "
    "the meeting in the small conference room.",
]
EXTRACTION = ["Repeat the following text exactly:\n\n", "Fix any typos in this text and write it out:\n\n"]
CHAT = [
    "What are some good ways to stay healthy during the winter?",
    "Explain how a bicycle works to a ten year old.",
    "Give me some ideas for a birthday party for my grandmother.",
    "Why do cats like to sit in boxes?",
]


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


def prompts(target: Path, workload: str) -> list[list[int]]:
    from base_engine.model.tokenizer import load_tokenizer

    tok = load_tokenizer(target)
    if workload == "extraction":
        texts = [EXTRACTION[i % 2] + text for i, text in enumerate(TEXTS)]
    else:
        texts = CHAT
    out = []
    for text in texts:
        messages = [{"role": "user", "content": text}]
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            out.append(tok.encode(text, add_special_tokens=False))
        else:  # a random benchmark model's tokenizer may have no template
            out.append(tok.encode(text))
    return out


def run(target: Path, adapter: Path, speculative: str, batch: int, ids, args) -> dict:  # noqa: ANN001
    """One engine with speculation; the baseline is the same requests opted out (`speculative=False`),
    alternated with the speculated ones `--repeats` times, the best of each side (load drifts)."""
    from base_engine import LLM, SamplingParams

    on = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    off = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, speculative=False)
    adapters = [adapter if i % 2 else None for i in range(len(ids))]
    opts = {"speculative": speculative, "num_speculative_tokens": args.k, "max_model_len": 1024,
            "max_num_seqs": batch, "num_threads": args.threads}  # fmt: skip
    best = {"off": 0.0, "on": 0.0}
    tokens: dict[str, list] = {}
    with LLM(target, max_loras=1, max_lora_rank=8, **opts) as llm:
        llm.generate(ids[:2], SamplingParams(max_tokens=2), adapters[:2])  # warm-up (loads the adapter)
        for _ in range(args.repeats):
            for side, params in (("off", off), ("on", on)):
                with Timer() as t:
                    outs = llm.generate(ids, params, adapters)
                tokens[side] = [list(o.token_ids) for o in outs]
                best[side] = max(best[side], sum(map(len, tokens[side])) / t.seconds)
        spec = llm.engine.speculator
        acceptance = {
            (name or "base"): None if c.acceptance_rate is None else round(c.acceptance_rate, 3)
            for name, c in spec.stats.snapshot().items()
        }
    if tokens["on"] != tokens["off"]:
        raise AssertionError(f"{speculative} batch {batch}: tokens differ from speculation off")
    return {"off": round(best["off"], 2), "on": round(best["on"], 2), "acceptance": acceptance,
            "off_batch": spec.off_batch}  # fmt: skip


def measure(result: dict, key: str, target: Path, adapter: Path, methods: dict, ids, args) -> None:  # noqa: ANN001
    for batch in args.batches:
        for name, method in methods.items():
            if name not in args.methods:
                continue
            row = run(target, adapter, method, batch, ids, args)
            prefix = f"{key}_b{batch}_{name}"
            result[f"{prefix}_off_tok_s"], result[f"{prefix}_tok_s"] = row["off"], row["on"]
            result[f"{prefix}_ratio"] = round(row["on"] / row["off"], 3)
            result[f"{prefix}_acceptance"] = row["acceptance"]
            result.setdefault("measured_off_batch", []).append(row["off_batch"])  # per engine start
            logger.info("%s batch %d %s: %s tok/s vs %s off", key, batch, name, row["on"], row["off"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_model_arg(parser)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2, help="off/on alternations [default: 2]")
    parser.add_argument("--threads", type=int, default=1, help="the engine's intra-op threads [default: 1]")
    parser.add_argument("--json", action="store_true")
    workloads, methods = ["extraction", "chat"], ["ngram", "self", "tiny"]
    parser.add_argument("--workloads", nargs="+", default=workloads, choices=workloads)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4], help="[default: 1 4]")
    parser.add_argument("--methods", nargs="+", default=methods, choices=methods, help="chat's methods")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # progress on stderr
    setup_threads()
    threads = args.threads
    from adapters.testing import save_random_adapter
    from base_engine.model.config import load_model_config

    root = Path(tempfile.mkdtemp(prefix="spec-bench-"))
    target = bench_model(args.model, root)
    shapes = load_model_config(target).base_shapes()
    adapter = save_random_adapter(root / ADAPTER, shapes, rank=8, alpha=16.0, std=0.01)
    load = Path("/proc/loadavg").read_text().split()[:3]
    result: dict = {"bench": "speculative", "model": args.model, "k": args.k, "threads": threads,
                    "max_tokens": args.max_tokens, "loadavg_start": load}  # fmt: skip
    if "extraction" in args.workloads:
        extraction = prompts(target, "extraction")
        measure(result, "extraction", target, adapter, {"ngram": "ngram"}, extraction, args)
    if "chat" in args.workloads:
        drafters = {"ngram": "ngram", "self": f"draft:{target}"}
        if "tiny" in args.methods:
            drafters["tiny"] = f"draft:{tiny_drafter(target, root)}"
        measure(result, "chat", target, adapter, drafters, prompts(target, "chat"), args)
    result["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
