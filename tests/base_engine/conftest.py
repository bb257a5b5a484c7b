"""Engine test fixtures: HF reference models, once per session (prompts: tests.harness.engine_inputs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="session")
def hf_model_cache():
    cache: dict[Path, torch.nn.Module] = {}

    def load(model_dir: Path) -> torch.nn.Module:
        if model_dir not in cache:
            cache[model_dir] = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.float32, attn_implementation="eager"
            ).eval()
        return cache[model_dir]

    return load
