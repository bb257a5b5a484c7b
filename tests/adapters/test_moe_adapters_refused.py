"""Adapters on the mixture-of-experts bases are refused by name (the base models are served; LoRA on
their experts and attention is not applied yet), never served as if the base model answered."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapters.format import MOE_MODEL_TYPES, load_adapter
from adapters.types import AdapterFormatError
from tests.harness.peft_adapters import save_peft_adapter, tiny_shapes


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_an_adapter_on_an_moe_base_is_refused_by_name(model_type: str, tmp_path: Path) -> None:
    adapter_dir = save_peft_adapter(tmp_path / "a", "llama", r=4, target_modules=["q_proj"])
    with pytest.raises(AdapterFormatError, match=f"mixture-of-experts base model_type='{model_type}'"):
        load_adapter(adapter_dir, base=tiny_shapes(model_type))
