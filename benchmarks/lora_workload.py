"""The multi-LoRA workload: random rank-16 adapters on all seven projections, drawn Zipf(1.0).

On a mixture-of-experts model (bench-moe) the adapters are PEFT's own: LoRA on q/k/v/o_proj plus
`target_parameters` on the fused expert tensors (mlp.experts.gate_up_proj / down_proj), random
non-zero B (init_lora_weights=False). peft cannot mix those adapters in one batch (its ParamWrapper
refuses `adapter_names`), so that baseline runs each adapter's requests as their own batches.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import torch

from adapters.testing import save_random_adapter
from base_engine.model.config import load_model_config


def make_lora_adapters(model_dir: Path, root: Path, *, num: int, rank: int, dora: bool = False) -> list[Path]:
    base = load_model_config(model_dir).base_shapes()
    return [
        save_random_adapter(root / f"adapter{i}", base, rank=rank, alpha=2 * rank, seed=i, dora=dora)
        for i in range(num)
    ]


MOE_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
MOE_TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def is_moe(model_dir: Path) -> bool:
    return load_model_config(model_dir).moe is not None


def make_peft_moe_adapters(model_dir: Path, root: Path, *, num: int, rank: int) -> list[Path]:
    """`num` PEFT adapters (attention + expert target_parameters) saved by peft as root/a0, root/a1, ..."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=MOE_TARGET_MODULES,
                        target_parameters=MOE_TARGET_PARAMETERS, init_lora_weights=False)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        peft_model = get_peft_model(model, config, adapter_name="a0")
        for i in range(1, num):
            torch.manual_seed(i)
            peft_model.add_adapter(f"a{i}", config)
        peft_model.save_pretrained(str(root))  # a named adapter goes to root/<name>
    return [root / f"a{i}" for i in range(num)]


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
