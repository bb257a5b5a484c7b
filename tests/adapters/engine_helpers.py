"""PEFT adapters built on a tiny checkpoint directory, and PEFT-wrapped HF models as the oracle."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kernels.sgmv import cost_model

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: Path, out: Path, *, seed: int, zero_b: bool = False, **lora_kwargs) -> Path:
    """Save a PEFT LoRA adapter for the checkpoint in `model_dir` (random A and B unless zero_b)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(init_lora_weights=zero_b, **lora_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(base, config)
    if not zero_b:
        with torch.no_grad():  # PEFT's random init is small; make the deltas matter for the tokens
            for name, param in model.named_parameters():
                if "lora_B" in name or "lora_A" in name:
                    param.mul_(4.0)
                elif "lora_magnitude_vector" in name:  # DoRA: m = ||W + s B A|| at init; move it off 1
                    param.mul_(0.5 + torch.rand_like(param))
    model.save_pretrained(out)
    return out


def peft_model(model_dir: Path, adapter_dir: Path | None):
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    if adapter_dir is None:
        return base.eval()
    from peft import PeftModel

    return PeftModel.from_pretrained(base, adapter_dir).eval()


def peft_references(
    model_dir: Path, adapters: dict[str, Path], names: list, prompts: list, max_new: int
) -> dict[int, tuple]:
    """Greedy tokens and logprobs of peft (or the base model, name None/"") for each prompt i, one PEFT
    model per distinct name in `names`."""
    from tests.base_engine.oracle import hf_greedy

    refs: dict[int, tuple] = {}
    for name in set(names):
        model = peft_model(model_dir, adapters[name] if name else None)
        for i, n in enumerate(names):
            if n == name:
                refs[i] = hf_greedy(model, prompts[i], max_new)
    return refs


def make_saved_adapter(
    model_dir: Path, out: Path, *, seed: int, copy_noise: float = 1.0, **lora_kwargs
) -> Path:
    """A PEFT adapter with modules_to_save copies moved off the base weights (noise `copy_noise` times
    the weights' mean magnitude)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "modules_to_save" in name:
                    param.add_(torch.randn_like(param) * param.abs().mean() * copy_noise)
                elif "lora_" in name:
                    param.mul_(4.0)
        model.save_pretrained(out)
    return out


def pin_schedule(monkeypatch: pytest.MonkeyPatch, schedule: str) -> None:
    """ "bag": every segment in bags (prefill runs too); "loop": no bags, the fused segment loop only."""
    # bag: bags cost nothing, a loop segment 1 s; loop: the bag schedule costs 1 s to start
    costs = (
        cost_model.ScheduleCosts(0.0, 0.0, 1.0, 0.0, 0.0)
        if schedule == "bag"
        else cost_model.ScheduleCosts(1.0, 0.0, 0.0, 0.0, 0.0)
    )
    monkeypatch.setattr(cost_model, "costs_for", lambda dtype, device: costs)
