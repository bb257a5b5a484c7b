"""Upload validation maps the weights file instead of reading it (reading a 500 MB upload
once added 1,000 MB resident): same verdicts and hashes as the in-memory path, the data offsets must tile the
file as the safetensors library requires, and no mapping outlives the call."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from adapters import AdapterFormatError, AdapterValidationError, load_adapter, validate_adapter
from adapters.files import read_adapter_files
from adapters.limits import max_adapter_weights_bytes, max_replacement_file_bytes
from tests.harness.peft_adapters import save_peft_adapter, tiny_shapes

WEIGHTS = "adapter_model.safetensors"
LIMITS = {"max_lora_rank": 64, "max_size_bytes": 10 << 20}


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_peft_adapter(tmp_path_factory.mktemp("ref") / "a", target_modules=["q_proj", "v_proj"])


def _mapped_paths() -> set[str]:
    return {line.split(maxsplit=5)[-1] for line in Path("/proc/self/maps").read_text().splitlines()}


def test_mapped_and_read_files_are_the_same_bytes(reference_dir: Path) -> None:
    read = read_adapter_files(reference_dir)
    mapped = read_adapter_files(reference_dir, mapped=True)
    try:
        assert bytes(mapped.weights_bytes) == read.weights_bytes
    finally:
        mapped.close()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_validation_leaves_no_mapping(reference_dir: Path) -> None:
    validate_adapter(reference_dir, base=tiny_shapes(), **LIMITS)
    assert str((reference_dir / WEIGHTS).resolve()) not in _mapped_paths()


def _rewrite_offsets(path: Path, shift: int) -> None:
    """Move every tensor after the first `shift` bytes later, leaving a gap (and a longer file)."""
    data = path.read_bytes()
    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + header_len])
    body = data[8 + header_len :]
    first = min((e["data_offsets"][0], n) for n, e in header.items() if n != "__metadata__")[1]
    for name, entry in header.items():
        if name not in ("__metadata__", first) and entry["data_offsets"][0] > 0:
            entry["data_offsets"] = [entry["data_offsets"][0] + shift, entry["data_offsets"][1] + shift]
    end_first = header[first]["data_offsets"][1]
    new_body = body[:end_first] + b"\0" * shift + body[end_first:]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + new_body)


def test_gap_between_tensors_is_refused_on_both_paths(reference_dir: Path, tmp_path: Path) -> None:
    adapter_dir = Path(shutil.copytree(reference_dir, tmp_path / "gap"))
    _rewrite_offsets(adapter_dir / WEIGHTS, shift=16)
    with pytest.raises(AdapterFormatError, match="could not be parsed"):
        validate_adapter(adapter_dir, base=tiny_shapes(), **LIMITS)
    with pytest.raises(AdapterFormatError, match="could not be parsed"):
        load_adapter(adapter_dir, base=tiny_shapes())


def test_validated_factors_match_the_loaded_ones(reference_dir: Path) -> None:
    from adapters.format import parse_adapter

    mapped = read_adapter_files(reference_dir, mapped=True)
    try:
        ours = parse_adapter(mapped, base=tiny_shapes())
        theirs = load_adapter(reference_dir, base=tiny_shapes())
        assert set(ours.weights) == set(theirs.weights)
        for key, pair in ours.weights.items():
            assert torch.equal(pair.a, theirs.weights[key].a) and torch.equal(pair.b, theirs.weights[key].b)
        del ours, pair
    finally:
        mapped.close()


def test_largest_legal_adapter_size() -> None:
    shapes = tiny_shapes()  # hidden 64, intermediate 128, 4 heads of 16, 2 KV heads, 2 layers, vocab 128
    per_layer_r1 = (64 + 64) + 2 * (64 + 32) + (64 + 64) + 3 * (64 + 128)
    magnitudes = 64 + 2 * 32 + 64 + 2 * 128 + 64  # DoRA: one per output feature of each projection
    embedding_and_head = 2 * 16 * (128 + 64)  # A [r, vocab] + B [hidden, r]; A [r, hidden] + B [vocab, r]
    expected = (2 * (per_layer_r1 * 16 + magnitudes) + embedding_and_head) * 4
    assert max_adapter_weights_bytes(shapes, 16) - expected == 64 * 1024 + (42 + 4) * 256
    # lm_head and embed_tokens: one [vocab, hidden] copy each; 5 norms of 64 (2 per layer and model.norm)
    copies = (2 * 128 * 64 + 5 * 64) * 4
    assert max_replacement_file_bytes(shapes, 1 << 30) == copies + 7 * 256
    assert max_replacement_file_bytes(shapes, 100) == copies - 5 * 64 * 4 + 200 + 7 * 256


_ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens",
                "lm_head"]  # fmt: skip


def test_largest_legal_adapter_with_embedding_and_head_lora_fits_the_limit(tmp_path: Path) -> None:
    """Every projection, embed_tokens and lm_head at the rank limit in fp32, with the base embedding and
    head PEFT saves beside them: accepted at the derived limit even with a tiny replacement budget (the
    saved base weights are not replacements); one rank more, or one byte less of limit, is refused."""
    shapes, budget = tiny_shapes(), 1024
    adapter_dir = save_peft_adapter(tmp_path / "max", r=16, lora_alpha=16, target_modules=_ALL_TARGETS)
    tensors = set(json.loads(_header(adapter_dir / WEIGHTS)))
    assert {n for n in tensors if "base_layer" in n} == {
        "base_model.model.model.embed_tokens.base_layer.weight", "base_model.model.lm_head.base_layer.weight",
    }  # fmt: skip
    limit = max_adapter_weights_bytes(shapes, 16) + max_replacement_file_bytes(shapes, budget)
    size = (adapter_dir / WEIGHTS).stat().st_size
    assert size <= limit
    summary = validate_adapter(adapter_dir, base=shapes, max_lora_rank=16, max_size_bytes=limit,
                               max_replacement_bytes=budget)  # fmt: skip
    assert summary.max_rank == 16
    with pytest.raises(AdapterValidationError, match=rf"is {size} bytes, above the limit of {size - 1}"):
        validate_adapter(adapter_dir, base=shapes, max_lora_rank=16, max_size_bytes=size - 1)
    over = save_peft_adapter(tmp_path / "over", r=17, lora_alpha=17, target_modules=_ALL_TARGETS)
    with pytest.raises(AdapterValidationError, match=r"has rank 17, above max_lora_rank=16"):
        validate_adapter(over, base=shapes, max_lora_rank=16, max_size_bytes=limit)


def _header(path: Path) -> bytes:
    data = path.read_bytes()
    return data[8 : 8 + struct.unpack("<Q", data[:8])[0]]
