"""Decode throughput at Llama-3-8B-like shapes on a GPU (random weights, bf16), with the weight-read
roofline: no adapter / one shared / 32 distinct rank-16 adapters at batch 32, and batch 1.

The roofline of a decode step is (bytes of weights + adapters read) / HBM bandwidth; batch-1 decode
should reach >= 70% of it, and 32 distinct adapters >= 0.9x the no-adapter decode (the targets).
Prints one JSON line. Needs CUDA; `--layers` trims the depth to keep the run short (the per-layer
shapes, hence the ratios, stay those of the 8B model).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from adapters.testing import save_random_adapter
from base_engine import SamplingParams
from base_engine.engine import LLMEngine
from base_engine.engine_config import EngineConfig
from base_engine.model.config import load_model_config
from base_engine.testing.checkpoint import save_random_checkpoint

HBM_GBPS = {"H200": 4800.0, "H100": 3350.0}
SHAPES = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
              vocab_size=128256, max_position_embeddings=4096)  # fmt: skip


def _decode_tok_s(engine: LLMEngine, batch: int, adapters: list, steps: int) -> float:
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        ref = None if not adapters else engine.lora.local_ref(adapters[i % len(adapters)])
        engine.add_request(
            f"b{batch}-{len(adapters)}-{i}-{time.monotonic_ns()}", [5 + i, 6, 7, 8], params, adapter=ref
        )
    while any(s.num_output_tokens < 2 for s in engine.requests.values()):  # prefill + adapter loads
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished:
        engine.step()
    return batch * steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_decode.py needs a CUDA device")
    root = Path(tempfile.mkdtemp(prefix="gpu-decode-"))
    model_dir = save_random_checkpoint(root / "model", num_hidden_layers=args.layers, dtype=torch.bfloat16,
                                       init_scale=0.5, **SHAPES)  # fmt: skip
    base = load_model_config(model_dir).base_shapes()
    adapters = [save_random_adapter(root / f"a{i}", base, rank=16, seed=i) for i in range(32)]
    config = EngineConfig(max_num_seqs=32, max_loras=32, max_cpu_loras=32, max_lora_rank=16,
                          max_model_len=1024, lora_memory_fraction=0.2)  # fmt: skip
    engine = LLMEngine(model_dir, device="cuda", dtype="bfloat16", config=config)
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    adapter_bytes = engine.lora.cache.pool.num_bytes // 32  # one slot, all seven projections
    name = torch.cuda.get_device_name()
    hbm = next((v for k, v in HBM_GBPS.items() if k in name), 3350.0) * 1e9
    base_bs1 = _decode_tok_s(engine, 1, [], args.steps)
    base_tok_s = _decode_tok_s(engine, 32, [], args.steps)
    one_tok_s = _decode_tok_s(engine, 32, adapters[:1], args.steps)
    distinct_tok_s = _decode_tok_s(engine, 32, adapters, args.steps)
    bound_bs1 = hbm / weight_bytes  # steps/s when only the weights are read
    result = {
        "benchmark": "gpu-decode", "device": name, "layers": args.layers, "weight_gb": weight_bytes / 1e9,
        "adapter_mb_each": adapter_bytes / 1e6, "batch1_tok_s": base_bs1, "batch1_roofline_tok_s": bound_bs1,
        "batch1_fraction_of_roofline": base_bs1 / bound_bs1, "base_tok_s": base_tok_s, "one_tok_s": one_tok_s,
        "distinct_tok_s": distinct_tok_s, "distinct_over_base": distinct_tok_s / base_tok_s,
        "roofline_distinct_tok_s": 32 * hbm / (weight_bytes + 32 * adapter_bytes),
        "targets": {"batch1_fraction_of_roofline": 0.7, "distinct_over_base": 0.9},
    }  # fmt: skip
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
