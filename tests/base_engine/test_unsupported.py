"""Architectures we do not serve are refused at load time naming the missing piece and the model table."""

from __future__ import annotations

from pathlib import Path

import pytest

from base_engine.model.config import SUPPORTED_ARCHITECTURES, load_model_config
from base_engine.model.unsupported import UNSUPPORTED_ARCHITECTURES
from tests.base_engine.published_configs import QWEN3_0_6B, write_config

README = Path(__file__).parents[2] / "base_engine" / "model" / "README.md"


@pytest.mark.parametrize(
    ("architecture", "missing"),
    [
        ("Gemma4ForCausalLM", r"per-layer input embeddings"),
        ("Qwen3_5ForCausalLM", r"Gated DeltaNet"),
        ("Qwen3NextForCausalLM", r"Gated DeltaNet.*mixture-of-experts"),
        ("GptOssForCausalLM", r"attention sinks.*MXFP4"),
        ("OlmoeForCausalLM", r"mixture-of-experts"),
        ("PhimoeForCausalLM", r"mixture-of-experts"),
        ("PhiForCausalLM", r"parallel attention \+ MLP"),
        ("Phi3SmallForCausalLM", r"block-sparse attention"),
    ],
)
def test_known_architecture_is_refused_with_its_missing_piece(
    tmp_path: Path, architecture: str, missing: str
) -> None:
    raw = {**QWEN3_0_6B, "architectures": [architecture], "model_type": "whatever"}
    with pytest.raises(ValueError, match=rf"{architecture} needs .*{missing}") as excinfo:
        load_model_config(write_config(tmp_path, raw))
    message = str(excinfo.value)
    assert str(tmp_path / "config.json") in message and "base_engine/model/README.md" in message


def test_unknown_architecture_and_rope_type_point_to_the_table(tmp_path: Path) -> None:
    raw = {**QWEN3_0_6B, "architectures": ["FalconForCausalLM"]}
    with pytest.raises(ValueError, match=r"FalconForCausalLM.*unsupported.*base_engine/model/README\.md"):
        load_model_config(write_config(tmp_path / "arch", raw))
    raw = {**QWEN3_0_6B, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    with pytest.raises(ValueError, match=r"rope type 'dynamic'.*base_engine/model/README\.md"):
        load_model_config(write_config(tmp_path / "rope", raw))


def test_the_readme_table_lists_what_is_served_and_refused() -> None:
    table = README.read_text()
    assert "## Supported model families" in table
    for architecture in [*SUPPORTED_ARCHITECTURES, *UNSUPPORTED_ARCHITECTURES]:
        assert f"`{architecture}`" in table, f"{architecture} is missing from {README}"
    assert not set(SUPPORTED_ARCHITECTURES) & set(UNSUPPORTED_ARCHITECTURES)
