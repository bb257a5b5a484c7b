"""The multi-LoRA workload: random rank-16 adapters on all seven projections, drawn Zipf(1.0)."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

from adapters.testing import save_random_adapter
from base_engine.model.config import load_model_config


def make_lora_adapters(model_dir: Path, root: Path, *, num: int, rank: int, dora: bool = False) -> list[Path]:
    base = load_model_config(model_dir).base_shapes()
    return [
        save_random_adapter(root / f"adapter{i}", base, rank=rank, alpha=2 * rank, seed=i, dora=dora)
        for i in range(num)
    ]


def zipf_assign(num_requests: int, num_adapters: int, *, seed: int, s: float = 1.0) -> list[int]:
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** s for k in range(num_adapters)]
    return rng.choices(range(num_adapters), weights=weights, k=num_requests)


def peft_model_with_adapters(hf_model, adapter_dirs: list[Path]):
    """One PeftModel holding every adapter under the names a0, a1, ..."""
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = PeftModel.from_pretrained(hf_model, adapter_dirs[0], adapter_name="a0")
        for i, d in enumerate(adapter_dirs[1:], start=1):
            model.load_adapter(d, adapter_name=f"a{i}")
    return model.eval()
