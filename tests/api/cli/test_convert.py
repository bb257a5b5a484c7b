"""`loraserve adapter convert DIR` (Typer's CliRunner on the real app): a peft-saved `adapter_model.bin`
becomes an `adapter_model.safetensors` that loads to PEFT's own deltas and passes upload validation; a
pickle that needs more than tensors is refused without running it, and a failure writes nothing."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import torch
from typer.testing import CliRunner

from adapters import load_adapter
from adapters.validation import validate_adapter
from api.cli.main import app
from tests.harness.peft_adapters import peft_deltas, tiny_model, tiny_shapes

WEIGHTS = "adapter_model.safetensors"


def _pickle_adapter(directory: Path) -> Path:
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(1)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        get_peft_model(tiny_model(), config).save_pretrained(str(directory), safe_serialization=False)
    assert (directory / "adapter_model.bin").is_file() and not (directory / WEIGHTS).exists()
    return directory


def _convert(directory: Path, *extra: str):
    return CliRunner().invoke(app, ["adapter", "convert", str(directory), *extra])


def test_converted_weights_load_as_peft_reads_the_pickle(tmp_path: Path) -> None:
    directory = _pickle_adapter(tmp_path / "a")
    theirs = peft_deltas(directory)  # PEFT reading the pickle itself (no safetensors file yet)
    result = _convert(directory)
    assert result.exit_code == 0, result.output
    assert f"wrote {directory / WEIGHTS}" in result.output
    ours = load_adapter(directory, base=tiny_shapes())
    assert set(ours.weights) == set(theirs) and len(ours.weights) == 4
    for (layer, module), pair in ours.weights.items():
        delta = pair.scale * pair.b.double() @ pair.a.double()
        torch.testing.assert_close(delta, theirs[(layer, module)], rtol=1e-12, atol=1e-12)
    limits = {"max_lora_rank": 8, "max_size_bytes": 1 << 20}
    assert validate_adapter(directory, base=tiny_shapes(), **limits).modules == ("q_proj", "v_proj")
    again = _convert(directory)  # an existing safetensors file is kept unless --force
    assert again.exit_code == 1 and "already exists; pass --force" in again.output
    assert _convert(directory, "--force").exit_code == 0


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204 - what a hostile pickle runs when it is unpickled naively
        return (Path.touch, (self.marker,))


def test_a_code_running_pickle_is_refused_and_never_runs(tmp_path: Path) -> None:
    directory = tmp_path / "evil"
    directory.mkdir()
    marker = tmp_path / "ran"
    with open(directory / "adapter_model.bin", "wb") as f:
        pickle.dump({"x.lora_A.weight": _Payload(marker)}, f)
    result = _convert(directory)
    assert result.exit_code == 1 and "cannot be read with torch.load(weights_only=True)" in result.output
    assert not marker.exists(), "the pickle's code ran"
    assert sorted(p.name for p in directory.iterdir()) == ["adapter_model.bin"]  # nothing written


def test_non_tensor_contents_and_a_missing_bin_are_named(tmp_path: Path) -> None:
    directory = tmp_path / "list"
    directory.mkdir()
    torch.save([torch.zeros(2)], directory / "adapter_model.bin")
    result = _convert(directory)
    assert result.exit_code == 1 and "holds list; expected a dict of tensor name -> tensor" in result.output
    torch.save({"a": torch.zeros(2), "b": 3}, directory / "adapter_model.bin")
    result = _convert(directory)
    assert result.exit_code == 1 and "entry 'b' is int; expected a tensor" in result.output
    assert sorted(p.name for p in directory.iterdir()) == ["adapter_model.bin"]
    empty = tmp_path / "empty"
    empty.mkdir()
    result = _convert(empty)
    assert result.exit_code == 1 and "adapter_model.bin does not exist" in result.output
