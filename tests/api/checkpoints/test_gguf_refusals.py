"""What the GGUF conversion refuses, each with the key, tensor or value named (api/checkpoints/gguf.py,
gguf_config.py): unknown architecture-specific metadata, an unsupported architecture, RoPE it cannot
state exactly, and files whose tensors and the model's parameters do not match one to one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from api.checkpoints.gguf import convert_gguf
from api.checkpoints.gguf_config import complete_config
from base_engine.testing.checkpoint import save_random_checkpoint
from base_engine.testing.tokenizer import build_tokenizer
from tests.api.checkpoints.gguf_writer import write_gguf

LLAMA = {
    "general.architecture": "llama",
    "llama.embedding_length": 64,
    "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2,
    "llama.rope.freq_base": 10000.0,
}


def _complete(metadata: dict[str, Any], tensors: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    tensors = tensors or {}
    config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64}
    shapes = {name: t.shape for name, t in tensors.items()}
    return complete_config(config, metadata, shapes, tensors.__getitem__, source="m.gguf")


def test_metadata_fields_are_read_from_the_file() -> None:
    config = _complete(LLAMA | {"llama.attention.layer_norm_rms_epsilon": 9.999999747378752e-06})
    assert config["rms_norm_eps"] == 1e-05 and config["head_dim"] == 16
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert config["pad_token_id"] is None and config["architectures"] == ["LlamaForCausalLM"]
    mistral = complete_config(
        {"model_type": "mistral", "sliding_window": 4096}, LLAMA, {}, {}.__getitem__, source="m.gguf"
    )  # transformers reads a llama file named "Mistral..." as Mistral, with MistralConfig's 4096 window
    assert mistral["architectures"] == ["MistralForCausalLM"] and mistral["sliding_window"] is None
    yarn = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}
    yarn |= {"llama.rope.scaling.original_context_length": 4096}
    assert _complete(LLAMA | yarn)["rope_parameters"] == {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
    }


@pytest.mark.parametrize(("arch", "layers"), [("gemma2", 46), ("gemma3", 62)])
def test_gemma_27b_attention_scale_and_missing_window_follow_llama_cpp(arch: str, layers: int) -> None:
    """llama.cpp scales the 27B sizes (known by layer count) by hidden/heads, the others by head_dim; a
    Gemma 3 file without a window has full attention on every layer."""
    metadata = {"general.architecture": arch, f"{arch}.embedding_length": 5376}
    metadata |= {f"{arch}.attention.head_count": 32, f"{arch}.attention.key_length": 128}
    config = {"model_type": "gemma3_text" if arch == "gemma3" else arch, "hidden_size": 5376}
    big = complete_config(config | {"num_hidden_layers": layers}, metadata, {}, {}.__getitem__, source="m")
    small = complete_config(config | {"num_hidden_layers": 4}, metadata, {}, {}.__getitem__, source="m")
    assert (big["query_pre_attn_scalar"], small["query_pre_attn_scalar"]) == (168, 128)
    assert small["layer_types"] == ["full_attention"] * 4 and small["sliding_window"] is None


def test_phi3_longrope_attention_factor_is_kept_when_it_is_not_the_default() -> None:
    metadata = {"general.architecture": "phi3", "phi3.embedding_length": 64, "phi3.attention.head_count": 4}
    metadata |= {"phi3.context_length": 64, "phi3.rope.scaling.original_context_length": 16}
    factors = {
        n: np.ones(8, dtype=np.float32) for n in ("rope_factors_long.weight", "rope_factors_short.weight")
    }
    shapes = {n: t.shape for n, t in factors.items()}
    config = {"model_type": "phi3", "num_hidden_layers": 2, "hidden_size": 64}
    default = complete_config(
        config,
        metadata | {"phi3.rope.scaling.attn_factor": 1.2247449},
        shapes,
        factors.__getitem__,
        source="m",
    )
    assert "attention_factor" not in default["rope_parameters"]  # sqrt(1 + ln 4 / ln 16) = 1.2247...
    given = complete_config(
        config, metadata | {"phi3.rope.scaling.attn_factor": 1.5}, shapes, factors.__getitem__, source="m"
    )
    assert (
        given["rope_parameters"]["attention_factor"] == 1.5
        and given["original_max_position_embeddings"] == 16
    )


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"llama.logit_scale": 2.0}, r"\['llama.logit_scale'\] not understood"),
        ({"llama.attention.sliding_window": 4}, r"llama.attention.sliding_window'\] not understood"),
        ({"llama.rope.scaling.type": "longrope"}, "rope.scaling.type='longrope'.*unsupported"),
        ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, "yarn with a factor and an"),
        ({"llama.rope.dimension_count": 8}, "rope.dimension_count=8 differs from the head size 16"),
        ({"llama.attention.value_length": 32}, "value_length=32 differs from key_length=16"),
        ({"llama.attention.head_count_kv": [2, 2]}, "head_count_kv must be one integer"),
        ({"general.architecture": "gemma4"}, "GGUF architecture 'gemma4' unsupported; expected one of"),
    ],
)
def test_what_cannot_be_stated_exactly_is_refused(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _complete(LLAMA | extra)


def test_llama3_rope_freqs_must_match_a_published_parameter_set() -> None:
    head_dim, base = 16, 500000.0
    inv_freq = 1.0 / (base ** (np.arange(0, head_dim, 2) / head_dim))
    unscaled = np.ones_like(inv_freq, dtype=np.float32)
    freqs = np.where(2 * np.pi / inv_freq > 8192, 3.0, 1.0).astype(np.float32)  # factor 3: not published
    metadata = LLAMA | {"llama.rope.freq_base": base}
    with pytest.raises(ValueError, match="rope_freqs tensor .* matches none of the published"):
        _complete(metadata, {"rope_freqs.weight": freqs})
    with pytest.raises(ValueError, match="matches none"):  # all ones is no Llama 3 config either
        _complete(metadata, {"rope_freqs.weight": unscaled})
    with pytest.raises(ValueError, match="LongRoPE factor tensors in a llama file"):
        _complete(metadata, {"rope_factors_long.weight": unscaled})


def _llama_gguf(tmp_path: Path, **kwargs: Any) -> Path:
    ckpt = save_random_checkpoint(tmp_path / "hf", arch="llama")
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    return write_gguf(model, build_tokenizer(512), tmp_path / "m.gguf", **kwargs)


def test_a_tensor_the_model_has_no_place_for_is_refused(tmp_path: Path) -> None:
    src = _llama_gguf(tmp_path, extra_tensors={"blk.0.attn_q.bias": np.zeros(64, dtype=np.float32)})
    with pytest.raises(ValueError, match=r"GGUF tensors \['blk.0.attn_q.bias'\] have no place"):
        convert_gguf(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out-*"))  # nothing half-written


def test_a_parameter_the_file_has_no_tensor_for_is_refused(tmp_path: Path) -> None:
    src = _llama_gguf(tmp_path, drop=("blk.1.ffn_down.weight",))
    with pytest.raises(ValueError, match=r"no tensor for \['model.layers.1.mlp.down_proj.weight'\]"):
        convert_gguf(src, tmp_path / "out", progress=False)


def test_an_unsupported_architecture_is_refused_before_loading(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "starcoder2")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'starcoder2' unsupported"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)
