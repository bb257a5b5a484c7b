"""Offline throughput: our engine vs `transformers` generate on the same model and requests.

    python benchmarks/throughput.py --suite base --json
    python benchmarks/throughput.py --suite lora --json

Prints one JSON line: engine_tok_s, hf_tok_s, ratio (only requested output tokens are counted).
The baseline runs static batches of 32 (left-padded, each batch until its longest request), as a
user of the library would; both run in this one process, side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Timer, bench_small, make_workload, setup_threads  # noqa: E402


def run_engine(model_dir: Path, wl, adapters: list[Path | None] | None) -> float:
    from base_engine import LLM, SamplingParams

    llm = LLM(
        model_dir,
        max_num_seqs=64,
        max_num_batched_tokens=1024,
        max_loras=8,
        max_cpu_loras=8,
        max_lora_rank=16,
    )
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    llm.generate(wl.prompts[:2], params[:2], adapters=adapters[:2] if adapters else None)  # warm-up
    with Timer() as t:
        outs = llm.generate(wl.prompts, params, adapters=adapters)
    assert sum(len(o.token_ids) for o in outs) == wl.num_requested_tokens
    return wl.num_requested_tokens / t.seconds


def hf_generate(model, wl, batch_size: int = 32, adapter_names: list[str] | None = None) -> float:
    with Timer() as t:
        for start in range(0, len(wl.prompts), batch_size):
            prompts = wl.prompts[start : start + batch_size]
            width = max(map(len, prompts))
            ids = torch.zeros((len(prompts), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(prompts):  # left padding, as generation needs
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            kwargs = {}
            if adapter_names is not None:
                kwargs["adapter_names"] = adapter_names[start : start + batch_size]
            with torch.inference_mode():
                model.generate(
                    ids,
                    attention_mask=mask,
                    do_sample=False,
                    pad_token_id=0,
                    eos_token_id=None,
                    max_new_tokens=max(wl.output_lens[start : start + batch_size]),
                    **kwargs,
                )
    return wl.num_requested_tokens / t.seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--suite", choices=["base", "lora"], default="base")
    parser.add_argument("--json", action="store_true", help="print one JSON line (the default output)")
    parser.add_argument("--num-requests", type=int, default=64)
    args = parser.parse_args()
    threads = setup_threads()
    from transformers import AutoModelForCausalLM

    wl = make_workload(args.num_requests)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench_small(Path(tmp))
        hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        if args.suite == "base":
            engine_tok_s = run_engine(model_dir, wl, None)
            hf_tok_s = hf_generate(hf, wl)
            extra = {}
        else:
            from benchmarks.lora_workload import hf_lora_generate, make_lora_adapters, zipf_assign

            adapter_dirs = make_lora_adapters(hf, Path(tmp) / "adapters", num=8, rank=16)
            names = zipf_assign(len(wl.prompts), len(adapter_dirs), seed=0)
            engine_tok_s = run_engine(model_dir, wl, [adapter_dirs[i] for i in names])
            hf_tok_s = hf_lora_generate(hf, adapter_dirs, wl, names, hf_generate)
            extra = {"num_adapters": len(adapter_dirs), "rank": 16}
    result = {
        "benchmark": f"throughput-{args.suite}",
        "model": "bench-small",
        "num_requests": len(wl.prompts),
        "requested_tokens": wl.num_requested_tokens,
        "threads": threads,
        "engine_tok_s": round(engine_tok_s, 2),
        "hf_tok_s": round(hf_tok_s, 2),
        "ratio": round(engine_tok_s / hf_tok_s, 3),
        **extra,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
