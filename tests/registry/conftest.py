"""Registry test fixtures: a migrated database session, an object store, PEFT-format adapters.

Adapters are written directly in PEFT's on-disk format (`base_model.model.<module>.lora_A.weight`
[r, in], `lora_B.weight` [out, r]) and checked by the real `adapters.validation.validate_adapter`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from sqlalchemy.orm import Session

from adapters.types import AdapterSummary, BaseModelShapes
from adapters.validation import validate_adapter
from registry.store import ObjectStore
from registry.stores import open_store

SHAPES = BaseModelShapes(
    model_type="llama",
    num_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
)
BASE_MODEL = "tiny-llama"
MAX_RANK = 16


def write_adapter(
    directory: Path, *, rank: int = 4, seed: int = 0, modules: tuple[str, ...] = ("q_proj", "v_proj")
) -> Path:
    """A valid LoRA adapter for SHAPES in `directory` (distinct bytes per seed)."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(SHAPES.num_layers):
        for module in modules:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            in_features, out_features = SHAPES.module_shape(module)
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator)
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(modules),
        "base_model_name_or_path": BASE_MODEL,
        "bias": "none",
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture
def validate() -> Callable[[Path], AdapterSummary]:
    return functools.partial(validate_adapter, base=SHAPES, max_lora_rank=MAX_RANK, max_size_bytes=1 << 20)


@pytest.fixture
def session(make_session: Callable[[], Session]) -> Iterator[Session]:
    with make_session() as s:
        yield s


@pytest.fixture
def local_store(tmp_path: Path) -> ObjectStore:
    return open_store((tmp_path / "objects").as_uri())


@pytest.fixture
def store(store_url: str) -> ObjectStore:
    """LocalStore and S3Store (moto server); the tests run once per backend."""
    return open_store(store_url, max_attempts=2)
