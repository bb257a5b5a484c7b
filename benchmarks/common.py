"""Shared pieces of the benchmarks: the models
(`--model bench-small|bench-qwen3|bench-gemma3|bench-moe|smollm2`) and the reference workload.

"bench-small" is a random Llama made in a temp dir; "bench-qwen3" a random Qwen3 of the same size class
(q/k norms, head_dim 128 with 8 heads, so q is twice the hidden size as in Qwen3-0.6B, tied
embeddings); "bench-gemma3" a random Gemma 3 of that size (5 windowed : 1 global layers, q/k norms,
GeGLU, head_dim 128); "bench-moe" a random Qwen3-MoE of that size (16 experts of width 256, top-4,
renormalised, every layer sparse); "smollm2" is the default served model (SmolLM2-135M-Instruct),
converted once into ./loraserve-data/models like `make serve` does.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from base_engine.testing.checkpoint import save_random_checkpoint

ROOT = Path(__file__).resolve().parent.parent
BENCH_SMALL = dict(
    arch="llama",
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=1408,
    vocab_size=32000,
    max_position_embeddings=2048,
)
# Random benchmark models (save_random_checkpoint kwargs), written under the benchmark's temp dir.
RANDOM_MODELS: dict[str, dict[str, Any]] = {
    "bench-small": BENCH_SMALL,
    "bench-qwen3": {
        **BENCH_SMALL,
        "arch": "qwen3",
        "head_dim": 128,
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
    },
    # Gemma 3's shape at bench-small's size: 5 windowed layers (window 512) to 1 global (8 layers:
    # globals at 5), q/k norms, head_dim 128 x 4 heads, local / global RoPE bases, tied, GeGLU.
    "bench-gemma3": {
        **BENCH_SMALL,
        "arch": "gemma3",
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "sliding_window": 512,
        "query_pre_attn_scalar": 128,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "tie_word_embeddings": True,
    },
    # Qwen3-MoE's shape at bench-small's size: every layer a sparse MoE block of 16 experts
    # (moe_intermediate_size 256), top-4 with norm_topk_prob, q/k norms, head_dim 64.
    "bench-moe": {
        **BENCH_SMALL,
        "arch": "qwen3_moe",
        "head_dim": 64,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 256,
        "norm_topk_prob": True,
        "rope_theta": 1000000.0,
    },
}
MODELS = (*RANDOM_MODELS, "smollm2")


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_requested_tokens(self) -> int:
        return sum(self.output_lens)


def bench_model(name: str, root: Path) -> Path:
    """The checkpoint directory of benchmark model `name` (random ones are written under `root` once)."""
    if name in RANDOM_MODELS:
        path = root / name
        if not (path / "config.json").exists():
            save_random_checkpoint(path, **RANDOM_MODELS[name])
        return path
    if name == "smollm2":
        from api.checkpoints.sources import ensure_default_model

        return ensure_default_model(ROOT / "loraserve-data" / "models")
    raise ValueError(f"unknown benchmark model {name!r}; expected one of {MODELS}")


def model_vocab(model_dir: Path) -> int:
    from base_engine.model.config import load_model_config

    return load_model_config(model_dir).vocab_size


def add_model_arg(parser) -> None:  # noqa: ANN001 - an argparse parser
    parser.add_argument("--model", choices=MODELS, default="bench-small", help="[default: bench-small]")


def make_workload(
    num: int = 64, seed: int = 0, prompt=(32, 256), output=(16, 128), vocab: int = 32000
) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(*prompt))] for _ in range(num)]
    return Workload(prompts, [rng.randint(*output) for _ in range(num)])


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


def setup_threads() -> int:
    threads = max(1, min(torch.get_num_threads(), 16))
    torch.set_num_threads(threads)
    return threads
