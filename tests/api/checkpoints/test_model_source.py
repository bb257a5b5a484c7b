"""`--model` resolution (api/checkpoints/sources.py) and the checkpoint's sampling defaults
(api/inference/sampling.py),
without the network: conversions are stubbed where a real one would take a minute."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from api.bootstrap import resolve_model
from api.checkpoints import sources as model_source
from api.checkpoints.gguf import CONVERSION_VERSION, MARKER_FILE, is_converted
from api.checkpoints.sources import (
    GEMMA3_270M,
    RANDOM_DEMO,
    SMOLLM2,
    PackagedModel,
    classify,
    ensure_default_model,
    ensure_gguf,
    last_served_model,
    record_served_model,
)
from api.inference.protocol import ChatCompletionRequest
from api.inference.sampling import generation_defaults, sampling_params
from api.settings import Settings


def test_classify_names_paths_and_errors(tmp_path: Path) -> None:
    assert classify(None).kind == "default" and classify(None).served_name == SMOLLM2.served_name
    assert classify("HuggingFaceTB/SmolLM2-135M-Instruct").kind == "default"
    assert classify(RANDOM_DEMO).served_name == "loraserve-demo"
    (tmp_path / "ckpt").mkdir()
    assert classify(tmp_path / "ckpt").kind == "checkpoint"
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert classify(tmp_path / "m.gguf") == model_source.ModelSource("gguf", str(tmp_path / "m.gguf"), "m")
    with pytest.raises(ValueError, match="no such directory or .gguf file"):
        classify(tmp_path / "missing")
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="expected a .gguf file"):
        classify(tmp_path / "x.bin")


def test_settings_follow_the_source(tmp_path: Path) -> None:
    s = Settings(data_dir=tmp_path)
    assert s.is_demo and not s.is_random_demo and s.model_name == SMOLLM2.served_name
    assert s.models_path == tmp_path / "models"
    r = Settings(model=Path(RANDOM_DEMO), data_dir=tmp_path, models_dir=tmp_path / "shared")
    assert r.is_random_demo and r.model_name == "loraserve-demo" and r.models_path == tmp_path / "shared"
    assert (resolve_model(r) / "config.json").is_file()  # the random checkpoint, made on first use


def test_gguf_converted_once_and_found_by_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []

    def fake_convert(gguf: Path, out: Path, **kwargs: object) -> Path:
        calls.append(gguf)
        out.mkdir(parents=True)
        (out / MARKER_FILE).write_text(json.dumps({"version": CONVERSION_VERSION}))
        return out

    monkeypatch.setattr(model_source, "convert_gguf", fake_convert)
    a = tmp_path / "a.gguf"
    a.write_bytes(b"GGUF one")
    copy = tmp_path / "elsewhere" / "b.gguf"
    copy.parent.mkdir()
    copy.write_bytes(b"GGUF one")
    first = ensure_gguf(a, tmp_path / "models", progress=False)
    assert ensure_gguf(copy, tmp_path / "models", progress=False) == first  # same bytes, same dir
    assert len(calls) == 1 and first.name.startswith("sha256-") and is_converted(first)
    a.write_bytes(b"GGUF two")
    assert ensure_gguf(a, tmp_path / "models", progress=False) != first and len(calls) == 2


def test_a_packaged_model_is_assembled_from_its_parts_checked_and_converted_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert classify("gemma3-270m") == model_source.ModelSource("packaged", "gemma3-270m", "gemma-3-270m")
    assert classify("google/gemma-3-270m").kind == "packaged" and len(GEMMA3_270M.parts) == 4
    chunks = {"pkg-a": b"GGUF first chunk, ", "pkg-b": b"second chunk"}
    for package, data in chunks.items():
        (tmp_path / package).write_bytes(data)
    whole = b"".join(chunks.values())
    model = PackagedModel(
        served_name="m", aliases=("m",), version="1", parts=(("pkg-a", "a/part00"), ("pkg-b", "b/part01")),
        gguf_name="m.gguf", sha256=hashlib.sha256(whole).hexdigest(), size_mb=1, generation_config=(),
    )  # fmt: skip
    monkeypatch.setattr(model_source, "_installed_part", lambda package, version, member: tmp_path / package)
    converted: list[bytes] = []

    def fake_convert(gguf: Path, out: Path, **kwargs: object) -> Path:
        converted.append(gguf.read_bytes())
        out.mkdir(parents=True)
        (out / MARKER_FILE).write_text(json.dumps({"version": CONVERSION_VERSION}))
        return out

    monkeypatch.setattr(model_source, "convert_gguf", fake_convert)
    out = ensure_default_model(tmp_path / "models", model=model, progress=False)
    assert converted == [whole] and out.name == f"sha256-{model.sha256}"
    assert (
        ensure_default_model(tmp_path / "models", model=model, progress=False) == out and len(converted) == 1
    )
    tampered = dataclasses.replace(model, sha256="0" * 64)
    with pytest.raises(RuntimeError, match=f"has SHA-256 {model.sha256}, expected 0000"):
        ensure_default_model(tmp_path / "models", model=tampered, progress=False)
    assert len(converted) == 1 and not (tmp_path / "models" / f"sha256-{'0' * 64}").exists()


def test_served_model_is_remembered_for_adapter_push(tmp_path: Path) -> None:
    assert last_served_model(tmp_path) is None
    record_served_model(tmp_path, classify(RANDOM_DEMO))
    assert last_served_model(tmp_path) == RANDOM_DEMO


def _chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def test_generation_config_defaults_apply_when_the_request_omits_them(tmp_path: Path) -> None:
    config = {"temperature": 0.2, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1, "eos_token_id": 2}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    defaults = generation_defaults(tmp_path)
    # top_k 50 is transformers' own default: not the checkpoint's (vLLM reads the diff dict too).
    assert defaults == {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}
    omitted = sampling_params(_chat(), num_prompt=3, max_model_len=64, index=0, defaults=defaults)
    assert (omitted.temperature, omitted.top_p, omitted.top_k, omitted.repetition_penalty) == (
        0.2,
        0.9,
        0,
        1.1,
    )
    given = sampling_params(
        _chat(temperature=0, top_p=1.0, repetition_penalty=1.0), num_prompt=3, max_model_len=64, index=0,
        defaults=defaults,
    )  # fmt: skip
    assert (given.temperature, given.top_p, given.repetition_penalty) == (0, 1.0, 1.0)
    assert generation_defaults(tmp_path / "none") == {}
