"""Hostile `modules_to_save` uploads (issue 26): a replacement matrix of the wrong shape (refused naming
the expected [vocab, hidden]), and an embedding replacement whose header claims 10 GB (refused by the
header's own check, or by its size, before a byte of its data is read)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from adapters import AdapterFormatError, load_adapter
from adapters.validation import validate_adapter
from tests.harness.peft_adapters import edit_config, edit_tensors, save_peft_adapter, tiny_shapes

WEIGHTS = "adapter_model.safetensors"
EMBED = "base_model.model.model.embed_tokens.weight"  # PEFT saves the copy under the module's name
HEAD = "base_model.model.lm_head.weight"
TEN_GB = 10 * 2**30


def _with_replacement(tmp_path: Path, module: str) -> Path:
    directory = save_peft_adapter(tmp_path / "a", target_modules=["q_proj"])
    edit_config(directory, modules_to_save=[module])
    return directory


def test_wrong_shape_lm_head_replacement_is_refused_by_name(tmp_path: Path) -> None:
    directory = _with_replacement(tmp_path, "lm_head")
    vocab, hidden = tiny_shapes().vocab_size, tiny_shapes().hidden_size
    edit_tensors(directory, lambda t: {**t, HEAD: torch.randn(vocab + 1, hidden - 1)})
    expected = rf"{HEAD} has shape \({vocab + 1}, {hidden - 1}\), expected \({vocab}, {hidden}\) "
    expected += r"\(\[vocab, hidden\]"
    with pytest.raises(AdapterFormatError, match=expected):
        load_adapter(directory, base=tiny_shapes())


def _ten_gb_header(directory: Path) -> int:
    """Rewrite the weights file as a header that names one 10 GB embedding replacement and a few
    bytes of data; returns the file's size."""
    claim = {"dtype": "F32", "shape": [TEN_GB // 4 // 64, 64], "data_offsets": [0, TEN_GB]}
    header = json.dumps({EMBED: claim})
    data = len(header).to_bytes(8, "little") + header.encode() + b"\0" * 64
    (directory / WEIGHTS).write_bytes(data)
    return len(data)


def test_ten_gb_embedding_replacement_header_is_refused(tmp_path: Path) -> None:
    directory = _with_replacement(tmp_path, "embed_tokens")
    size = _ten_gb_header(directory)
    assert size < 1024  # the refusal cannot have come from reading the claimed 10 GB
    needs = rf"{EMBED}.* needs bytes \[0, {TEN_GB}\) of a 64-byte data section"
    with pytest.raises(AdapterFormatError, match=needs):
        validate_adapter(directory, base=tiny_shapes(), max_lora_rank=64, max_size_bytes=2**20)


def test_ten_gb_embedding_replacement_file_is_refused_before_reading(tmp_path: Path) -> None:
    directory = _with_replacement(tmp_path, "embed_tokens")
    with open(directory / WEIGHTS, "r+b") as f:  # sparse: 10 GB apparent, no disk used
        f.truncate(TEN_GB)
    assert os.path.getsize(directory / WEIGHTS) == TEN_GB
    with pytest.raises(AdapterFormatError, match=f"is {TEN_GB} bytes, above the limit of {2**20}"):
        validate_adapter(directory, base=tiny_shapes(), max_lora_rank=64, max_size_bytes=2**20)
