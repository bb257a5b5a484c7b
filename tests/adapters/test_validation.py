"""adapters.validation: the typed summary, and each upload check failing with its cause named."""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from adapters import AdapterFormatError, AdapterValidationError, validate_adapter
from tests.harness.peft_adapters import edit_tensors, save_peft_adapter, tiny_model, tiny_shapes

LIMITS = {"max_lora_rank": 64, "max_size_bytes": 10 << 20}
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """r=8 on q/v of both layers, built with peft."""
    return save_peft_adapter(tmp_path_factory.mktemp("ref") / "a", target_modules=["q_proj", "v_proj"])


@pytest.fixture
def adapter_copy(reference_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(reference_dir, tmp_path / "a"))


def test_summary_fields(tmp_path: Path) -> None:
    adapter_dir = save_peft_adapter(
        tmp_path / "a",
        r=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"layers.1.mlp.down_proj": 16, "v_proj": 4},
    )
    summary = validate_adapter(adapter_dir, base=tiny_shapes(), **LIMITS)
    weights = (adapter_dir / WEIGHTS).read_bytes()
    assert summary.ranks == {"q_proj": 8, "v_proj": 4, "down_proj": 16}
    assert summary.modules == ("q_proj", "v_proj", "down_proj")
    assert summary.max_rank == 16
    assert summary.num_layers_covered == 2
    assert summary.size_bytes == len(weights)
    assert summary.sha256 == hashlib.sha256(weights).hexdigest()
    assert (
        summary.config_sha256
        == hashlib.sha256((adapter_dir / "adapter_config.json").read_bytes()).hexdigest()
    )


def test_layers_covered_counts_only_adapted_layers(tmp_path: Path) -> None:
    adapter_dir = save_peft_adapter(tmp_path / "a", target_modules=["o_proj"], layers_to_transform=[1])
    summary = validate_adapter(adapter_dir, base=tiny_shapes(), **LIMITS)
    assert summary.num_layers_covered == 1 and summary.modules == ("o_proj",)


def test_qwen2_base_shapes_validate(tmp_path: Path) -> None:
    adapter_dir = save_peft_adapter(tmp_path / "a", "qwen2", target_modules="all-linear")
    assert validate_adapter(adapter_dir, base=tiny_shapes("qwen2"), **LIMITS).max_rank == 8


def test_pickle_only_is_never_loaded(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(tiny_model(), LoraConfig(target_modules=["q_proj"], init_lora_weights=False))
        model.save_pretrained(str(tmp_path / "a"), safe_serialization=False)
    assert (tmp_path / "a" / "adapter_model.bin").exists()
    with pytest.raises(
        AdapterFormatError,
        match=r"pickle weights are never read; convert them locally with `loraserve adapter convert DIR`",
    ):
        validate_adapter(tmp_path / "a", base=tiny_shapes(), **LIMITS)


def test_missing_config(adapter_copy: Path) -> None:
    (adapter_copy / "adapter_config.json").unlink()
    with pytest.raises(AdapterFormatError, match="adapter_config.json is missing"):
        validate_adapter(adapter_copy, base=tiny_shapes(), **LIMITS)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(AdapterFormatError, match="does not exist"):
        validate_adapter(tmp_path / "nope", base=tiny_shapes(), **LIMITS)


def test_config_not_json(adapter_copy: Path) -> None:
    (adapter_copy / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterFormatError, match="not valid JSON"):
        validate_adapter(adapter_copy, base=tiny_shapes(), **LIMITS)


@pytest.mark.parametrize("keep", ["4 bytes", "half header", "half data", "all but one byte"])
def test_truncated_safetensors(keep: str, adapter_copy: Path) -> None:
    data = (adapter_copy / WEIGHTS).read_bytes()
    header_end = 8 + int.from_bytes(data[:8], "little")
    cut = {"4 bytes": 4, "half header": header_end // 2, "half data": (header_end + len(data)) // 2}
    (adapter_copy / WEIGHTS).write_bytes(data[: cut.get(keep, len(data) - 1)])
    with pytest.raises(AdapterFormatError, match="truncated"):
        validate_adapter(adapter_copy, base=tiny_shapes(), **LIMITS)


def test_corrupt_header_json(adapter_copy: Path) -> None:
    header = b"{garbage"
    (adapter_copy / WEIGHTS).write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(AdapterFormatError, match="header is not valid JSON"):
        validate_adapter(adapter_copy, base=tiny_shapes(), **LIMITS)


def test_header_offsets_inconsistent_with_shape(adapter_copy: Path) -> None:
    data = (adapter_copy / WEIGHTS).read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [header[name]["shape"][0] * 2, header[name]["shape"][1]]
    blob = json.dumps(header).encode()
    (adapter_copy / WEIGHTS).write_bytes(len(blob).to_bytes(8, "little") + blob + data[8 + n :])
    with pytest.raises(AdapterFormatError, match=f"tensor '{name}'"):
        validate_adapter(adapter_copy, base=tiny_shapes(), **LIMITS)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights(bad: float, adapter_copy: Path) -> None:
    def poison(ts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
        ts[key][3, 2] = bad
        return ts

    edit_tensors(adapter_copy, poison)
    with pytest.raises(
        AdapterValidationError, match=r"layers\.1\.self_attn\.v_proj\.lora_B\.weight has non-finite"
    ):
        validate_adapter(adapter_copy, base=tiny_shapes(), **LIMITS)


def test_values_overflowing_the_serving_dtype(adapter_copy: Path) -> None:
    def scale_up(ts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        ts[key][0, 0] = 1e6  # finite in fp32, inf in fp16
        return ts

    edit_tensors(adapter_copy, scale_up)
    validate_adapter(adapter_copy, base=tiny_shapes(), **LIMITS)
    with pytest.raises(AdapterValidationError, match="non-finite values"):
        validate_adapter(adapter_copy, base=tiny_shapes(), dtype=torch.float16, **LIMITS)


def test_rank_above_limit(reference_dir: Path) -> None:
    with pytest.raises(AdapterValidationError, match="rank 8, above max_lora_rank=4"):
        validate_adapter(reference_dir, base=tiny_shapes(), max_lora_rank=4, max_size_bytes=10 << 20)


def test_wrong_hidden_size(reference_dir: Path) -> None:
    other_base = tiny_shapes(hidden_size=128)
    with pytest.raises(
        AdapterFormatError, match=r"q_proj\.lora_A\.weight has shape \(8, 64\), expected \(8, 128\)"
    ):
        validate_adapter(reference_dir, base=other_base, **LIMITS)


def test_wrong_kv_heads(reference_dir: Path) -> None:
    with pytest.raises(
        AdapterFormatError, match=r"v_proj\.lora_B\.weight has shape \(32, 8\), expected \(64, 8\)"
    ):
        validate_adapter(reference_dir, base=tiny_shapes(num_key_value_heads=4), **LIMITS)


def test_oversize_file_refused_before_reading(adapter_copy: Path) -> None:
    size = (adapter_copy / WEIGHTS).stat().st_size
    with pytest.raises(AdapterValidationError, match=f"{size} bytes, above the limit of {size - 1}"):
        validate_adapter(adapter_copy, base=tiny_shapes(), max_lora_rank=64, max_size_bytes=size - 1)
    # Garbage of the same size gives the size error, not a parse error: the size is checked first.
    (adapter_copy / WEIGHTS).write_bytes(b"\xff" * size)
    with pytest.raises(AdapterValidationError, match="above the limit"):
        validate_adapter(adapter_copy, base=tiny_shapes(), max_lora_rank=64, max_size_bytes=size - 1)


def test_errors_are_value_errors() -> None:
    assert issubclass(AdapterValidationError, AdapterFormatError) and issubclass(
        AdapterFormatError, ValueError
    )
