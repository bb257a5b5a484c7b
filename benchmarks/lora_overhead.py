"""Decode throughput at batch 32: no adapter, one shared adapter, 32 distinct adapters, 32 distinct DoRA,
32 distinct adapters each with its own `modules_to_save` lm_head.

    python benchmarks/lora_overhead.py --json                   # bench-small
    python benchmarks/lora_overhead.py --model smollm2 --json   # the default served model
    python benchmarks/lora_overhead.py --dtype bfloat16 --json  # bfloat16 weights, factors and KV

Three engines (same model, configuration and prompts; only the adapters differ) each hold 32 running
requests past their prefills; their decode steps are interleaved one by one (the order rotating every
round) and each case's tokens/s is 32 / its median step time. Interleaving single steps (~0.1 s) lets a
burst of load from other work on a shared machine hit all three cases alike, and the median drops the
steps it hit hardest. Targets: one_over_base >= 0.85, distinct_over_base >= 0.70, and 32 distinct DoRA
adapters vs 32 distinct plain ones dora_over_lora >= 0.9 (same factors plus the per-slot output scale).
Prints the bytes read per decode step (base weights + the distinct adapters' factors) with each figure.
`distinct8_over_base`: 8 distinct adapters round-robin over the 32 rows. On an MoE model (`--model
bench-moe`) the adapters are peft's, on q/k/v/o_proj and the expert tensors, and there is no DoRA case.
`heads_over_shared`: the 32 distinct adapters, each also with its own lm_head copy (modules_to_save), vs
the same adapters sharing the base head, with `bytes_per_step_heads` (32 heads read instead of one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Timer, add_model_arg, bench_model, setup_threads  # noqa: E402
from benchmarks.lora_workload import is_moe, make_lora_adapters, make_peft_moe_adapters  # noqa: E402

BATCH = 32
PROMPT_LEN = 32
HEAD = "base_model.model.lm_head.weight"  # PEFT's name for a modules_to_save copy of lm_head


def with_own_heads(dirs: list[Path], root: Path, head) -> list[Path]:
    """Copies of `dirs`, each with its own lm_head (`head` [vocab, hidden] plus noise) in modules_to_save."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out = []
    for i, d in enumerate(dirs):
        target = shutil.copytree(d, root / d.name)
        weights = target / "adapter_model.safetensors"
        tensors = load_file(str(weights))
        noise = torch.randn(head.shape, generator=torch.Generator().manual_seed(i)) * 0.01
        tensors[HEAD] = (head.float() + noise).contiguous()
        save_file(tensors, str(weights))
        config = json.loads((target / "adapter_config.json").read_text())
        config["modules_to_save"] = ["lm_head"]
        (target / "adapter_config.json").write_text(json.dumps(config))
        out.append(target)
    return out


def start_decoding(engine, refs: list, num_steps: int) -> None:
    """Add BATCH requests (one adapter each, or None) and step until every one has its first token."""
    from base_engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 8, ignore_eos=True)
    for i, ref in enumerate(refs):
        engine.add_request(f"r{i}", [10 + (i * 7 + j) % 1000 for j in range(PROMPT_LEN)], params, adapter=ref)
    while any(s.num_output_tokens == 0 for s in engine.requests.values()):  # prefills (and adapter loads)
        engine.step()


def interleaved_step_seconds(engines: dict, num_steps: int) -> dict[str, list[float]]:
    """Each engine's decode step times, stepping the engines in turn (rotating order every round)."""
    times: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for step in range(num_steps):
        for name in names[step % len(names) :] + names[: step % len(names)]:
            with Timer() as t:
                engines[name].step()
            times[name].append(t.seconds)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line (the default output)")
    parser.add_argument("--steps", type=int, default=60, help="decode steps per case")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"),
                        help="serving dtype of all four engines [default: float32]")  # fmt: skip
    add_model_arg(parser)
    args = parser.parse_args()
    threads = setup_threads()
    from base_engine import EngineConfig, LLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench_model(args.model, Path(tmp))
        moe = is_moe(model_dir)  # adapters on attention and the experts, built by peft; no DoRA case
        make = make_peft_moe_adapters if moe else make_lora_adapters
        dirs = make(model_dir, Path(tmp) / "adapters", num=BATCH, rank=16)
        dora_dirs = (
            [] if moe else make_lora_adapters(model_dir, Path(tmp) / "dora", num=BATCH, rank=16, dora=True)
        )
        config = EngineConfig(max_num_seqs=BATCH, max_loras=BATCH, max_cpu_loras=BATCH, max_lora_rank=16,
                              num_kv_blocks=BATCH * ((PROMPT_LEN + args.steps + 8) // 16 + 2))  # fmt: skip
        names = ("base", "one", "distinct8", "distinct", "heads") + (() if moe else ("dora",))
        engines = {name: LLMEngine(model_dir, dtype=args.dtype, config=config) for name in names}
        head = engines["base"].runner.model.lm_head.weight.detach()
        head_dirs = with_own_heads(dirs, Path(tmp) / "heads", head)
        refs = [engines["one"].lora.local_ref(d) for d in dirs]
        dora_refs = [engines["one"].lora.local_ref(d) for d in dora_dirs]
        head_refs = [engines["heads"].lora.local_ref(d) for d in head_dirs]
        eight = [refs[i % 8] for i in range(BATCH)]
        cases = {"base": [None] * BATCH, "one": [refs[0]] * BATCH, "distinct8": eight, "distinct": refs,
                 "dora": dora_refs, "heads": head_refs}  # fmt: skip
        for name, engine in engines.items():
            start_decoding(engine, cases[name], args.steps)
        times = interleaved_step_seconds(engines, args.steps)
        tok_s = {name: BATCH / statistics.median(t) for name, t in times.items()}
        cfg = engines["base"].model_config
        base_bytes = sum(p.numel() * p.element_size() for p in engines["base"].runner.model.parameters())
        element = engines["base"].dtype.itemsize
        base_bytes -= (
            cfg.vocab_size * cfg.hidden_size * element * (0 if cfg.tie_word_embeddings else 1)
        )  # embedding rows
        dtype_name = str(engines["base"].dtype).removeprefix("torch.")
        adapter_bytes = sum((d / "adapter_model.safetensors").stat().st_size for d in dirs)
        head_bytes = head.numel() * head.element_size()  # each row's own head read, not the shared one
    result = {
        "benchmark": "lora-overhead", "model": args.model, "dtype": dtype_name,
        "batch": BATCH, "rank": 16, "threads": threads,
        "steps": args.steps, "base_tok_s": round(tok_s["base"], 2), "one_tok_s": round(tok_s["one"], 2),
        "distinct_tok_s": round(tok_s["distinct"], 2),
        "one_over_base": round(tok_s["one"] / tok_s["base"], 3),
        "distinct_over_base": round(tok_s["distinct"] / tok_s["base"], 3),
        "distinct8_over_base": round(tok_s["distinct8"] / tok_s["base"], 3),
        "dora_tok_s": round(tok_s["dora"], 2) if "dora" in tok_s else None,
        "dora_over_lora": round(tok_s["dora"] / tok_s["distinct"], 3) if "dora" in tok_s else None,
        "bytes_per_step_base": base_bytes, "bytes_per_step_one": base_bytes + adapter_bytes // BATCH,
        "bytes_per_step_distinct": base_bytes + adapter_bytes,
        "heads_tok_s": round(tok_s["heads"], 2),
        "heads_over_shared": round(tok_s["heads"] / tok_s["distinct"], 3),
        "bytes_per_step_heads": base_bytes + adapter_bytes + (BATCH - 1) * head_bytes,
    }  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
