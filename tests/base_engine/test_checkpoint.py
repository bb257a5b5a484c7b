"""CheckpointReader over single and sharded safetensors, its errors, and the tiny checkpoints themselves.

Oracle for tensor values: the model `transformers` loads from the same directory.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from base_engine.model.checkpoint import INDEX_FILE, CheckpointReader, MissingTensorError
from base_engine.testing.checkpoint import save_random_checkpoint
from base_engine.testing.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def sharded_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, local_files_only=True)
    out = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(out, safe_serialization=True, max_shard_size="50KB")
    return out


def _hf_state(model_dir: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    return {k: v for k, v in model.state_dict().items() if "rotary_emb" not in k}


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_llama_tied_dir"])
def test_single_file_matches_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(fixture)
    reader = CheckpointReader(model_dir)
    state = _hf_state(model_dir)
    if fixture == "tiny_llama_tied_dir":
        # Tied: transformers stores the embedding once and shares it with lm_head.
        assert "lm_head.weight" not in reader
        state.pop("lm_head.weight")
    assert set(reader.names()) == set(state)
    assert reader.files() == ["model.safetensors"]
    for name, expected in state.items():
        torch.testing.assert_close(reader.get(name), expected, rtol=0, atol=0)
        assert reader.shape(name) == tuple(expected.shape)
        assert reader.file_of(name) == model_dir / "model.safetensors"


def test_sharded_reads_every_tensor_from_its_shard(sharded_dir: Path, tiny_llama_dir: Path) -> None:
    index = json.loads((sharded_dir / INDEX_FILE).read_text())["weight_map"]
    assert len(set(index.values())) > 2, "max_shard_size should have split the weights"
    assert not (sharded_dir / "model.safetensors").exists()
    reader = CheckpointReader(sharded_dir)
    single = CheckpointReader(tiny_llama_dir)
    assert reader.names() == single.names() == sorted(index)
    assert reader.files() == sorted(set(index.values()))
    for name in reader.names():
        assert reader.file_of(name) == sharded_dir / index[name]
        torch.testing.assert_close(reader.get(name), single.get(name), rtol=0, atol=0)


def test_dtype_cast(tiny_llama_dir: Path) -> None:
    reader = CheckpointReader(tiny_llama_dir)
    name = "model.layers.0.self_attn.q_proj.weight"
    value = reader.get(name, dtype=torch.bfloat16)
    assert value.dtype == torch.bfloat16
    torch.testing.assert_close(value, reader.get(name).to(torch.bfloat16), rtol=0, atol=0)


def test_missing_tensor_names_tensor_dir_and_files(tiny_llama_dir: Path) -> None:
    reader = CheckpointReader(tiny_llama_dir)
    name = "model.layers.2.mlp.up_proj.weight"  # the tiny model has 2 layers
    with pytest.raises(MissingTensorError, match=r"'model\.layers\.2\.mlp\.up_proj\.weight'") as excinfo:
        reader.get(name)
    assert str(tiny_llama_dir) in str(excinfo.value) and "model.safetensors" in str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)
    with pytest.raises(MissingTensorError):
        reader.file_of(name)


def test_shape_mismatch_names_tensor_file_and_shapes(tiny_llama_dir: Path) -> None:
    reader = CheckpointReader(tiny_llama_dir)
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match=r"up_proj\.weight.*model\.safetensors.*\(128, 64\).*\(64, 128\)"):
        reader.get(name, expected_shape=(64, 128))
    assert reader.get(name, expected_shape=(128, 64)).shape == (128, 64)


def test_shard_listed_but_missing(sharded_dir: Path, tmp_path: Path) -> None:
    broken = Path(shutil.copytree(sharded_dir, tmp_path / "broken"))
    index = json.loads((broken / INDEX_FILE).read_text())["weight_map"]
    victim = sorted(set(index.values()))[1]
    (broken / victim).unlink()
    with pytest.raises(FileNotFoundError, match=victim.replace(".", r"\.")):
        CheckpointReader(broken)


def test_index_pointing_at_wrong_shard(sharded_dir: Path, tmp_path: Path) -> None:
    broken = Path(shutil.copytree(sharded_dir, tmp_path / "broken"))
    index = json.loads((broken / INDEX_FILE).read_text())
    name = "model.norm.weight"
    other = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name])
    index["weight_map"][name] = other
    (broken / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(MissingTensorError, match=rf"'model\.norm\.weight'.*{other.replace('.', '[.]')}"):
        CheckpointReader(broken).get(name)


def test_pickle_only_is_refused(tmp_path: Path) -> None:
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*safetensors"):
        CheckpointReader(tmp_path)


def test_no_weights_at_all(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        CheckpointReader(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        CheckpointReader(tmp_path / "nope")


def test_unindexed_files_are_scanned_and_duplicates_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    shutil.copy(tiny_llama_dir / "model.safetensors", loose / "part-a.safetensors")
    assert CheckpointReader(loose).names() == CheckpointReader(tiny_llama_dir).names()
    shutil.copy(tiny_llama_dir / "model.safetensors", loose / "part-b.safetensors")
    with pytest.raises(ValueError, match=r"in both part-a\.safetensors and part-b\.safetensors"):
        CheckpointReader(loose)


# --- the tiny checkpoints themselves -----------------------------------------------------------


def test_tiny_weights_are_all_randomised(tiny_qwen2_dir: Path) -> None:
    """Norm weights != 1 and biases != 0, so an engine that skipped loading them would not match."""
    reader = CheckpointReader(tiny_qwen2_dir)
    for name in reader.names():
        value = reader.get(name)
        if "norm" in name:
            assert not torch.allclose(value, torch.ones_like(value)), name
        else:
            assert value.abs().max() > 0 and value.std() > 0.01, name
    assert "model.layers.0.self_attn.q_proj.bias" in reader


def test_tiny_logits_are_not_near_ties(tiny_llama_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, local_files_only=True)
    input_ids = torch.randint(0, 500, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids).logits  # [4, 32, vocab]
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[..., 0] - top2[..., 1]
    assert (gaps > 1e-3).float().mean() > 0.9


def test_tiny_checkpoint_is_deterministic_and_seeded(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    a = CheckpointReader(make_checkpoint(arch="mistral", seed=1))
    b = CheckpointReader(save_random_checkpoint(tmp_path / "again", arch="mistral", seed=1))
    c = CheckpointReader(save_random_checkpoint(tmp_path / "other", arch="mistral", seed=7))
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(a.get(name), b.get(name)) and not torch.equal(a.get(name), c.get(name))


def test_tiny_mistral_is_servable(tiny_mistral_dir: Path) -> None:
    assert json.loads((tiny_mistral_dir / "config.json").read_text())["sliding_window"] is None


def test_tiny_vocab_covers_tokenizer(make_checkpoint: Callable[..., Path]) -> None:
    model_dir = make_checkpoint(vocab_size=1000)
    assert CheckpointReader(model_dir).shape("model.embed_tokens.weight")[0] == 1000
    assert len(build_tokenizer()) <= 1000
    with pytest.raises(ValueError, match="vocab_size=200"):
        save_random_checkpoint(model_dir.parent / "small", vocab_size=200)
