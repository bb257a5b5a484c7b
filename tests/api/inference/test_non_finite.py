"""A request whose adapter makes its activations overflow gets a 400 naming the adapter and the cause
(`non_finite_activations`), in the JSON body and in the stream's error event, never a 500; requests
of other tenants running beside it are unaffected.

The base model here has RMSNorm weights of 1e12 (activations far above what the upload bound
assumes, adapters/README.md), so an adapter the upload checks accept still overflows q.k in the step:
what the engine's per-row check must catch whatever the upload bound admits.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from adapters.testing import save_random_adapter
from api.app import create_app
from api.bootstrap import build_state
from api.settings import Settings
from base_engine.model.config import load_model_config
from base_engine.testing.checkpoint import save_random_checkpoint
from tests.harness.uploads import files_of

ADMIN = "lsa-non-finite-admin"
BASE = "loud-llama"
NORM_GAIN = 1e12


def _loud_checkpoint(path: Path) -> Path:
    """A tiny Llama whose attention inputs are ~1e12: finite on its own, an overflow with a big q/k delta."""
    model_dir = save_random_checkpoint(path, max_position_embeddings=256)
    weights = model_dir / "model.safetensors"
    tensors = load_file(str(weights))
    for name in tensors:
        if name.endswith("input_layernorm.weight"):
            tensors[name] = tensors[name] * NORM_GAIN
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _loud_checkpoint(tmp_path_factory.mktemp("loud") / "model")


@pytest.fixture(scope="module")
def client(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = Settings(
        model=model_dir, served_model_name=BASE, data_dir=tmp_path_factory.mktemp("data"),
        admin_key=ADMIN, max_model_len=256, num_kv_blocks=128, max_num_seqs=8, max_loras=2,
        max_cpu_loras=4, max_lora_rank=16,
    )  # fmt: skip
    with TestClient(create_app(build_state(settings)), raise_server_exceptions=False) as started:
        yield started


def _tenant(client: TestClient) -> dict[str, str]:
    r = client.post(
        "/admin/api/tenants",
        json={"name": f"nf-{uuid.uuid4().hex[:8]}"},
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['api_key']}"}


@pytest.fixture(scope="module")
def overflowing(
    client: TestClient, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    """A tenant with adapter `overflow` (q/k factors of std 1000: accepted at upload, inf in the step)."""
    headers = _tenant(client)
    base = load_model_config(model_dir).base_shapes()
    adapter = save_random_adapter(
        tmp_path_factory.mktemp("a") / "a", base, rank=4, modules=["q_proj", "k_proj"], std=1000.0
    )
    parts = [("files", (n, content, "application/octet-stream")) for n, content in files_of(adapter).items()]
    r = client.post("/v1/adapters", headers=headers, data={"name": "overflow"}, files=parts)
    assert r.status_code == 201, r.text
    return headers


def _complete(client: TestClient, headers: dict[str, str], model: str, **extra: Any) -> Any:
    body = {"model": model, "prompt": "hello there", "max_tokens": 8, "ignore_eos": True, **extra}
    return client.post("/v1/completions", headers=headers, json=body)


def _assert_named_error(error: dict[str, Any]) -> None:
    assert error["code"] == "non_finite_activations", error
    assert error["type"] == "invalid_request_error" and error["param"] == "model", error
    assert "`overflow`" in error["message"] and "non-finite activations" in error["message"], error


def test_overflowing_adapter_is_a_400_naming_it_and_others_are_unaffected(
    client: TestClient, overflowing: dict[str, str]
) -> None:
    victim = _tenant(client)
    with ThreadPoolExecutor(max_workers=5) as pool:
        evil = [pool.submit(_complete, client, overflowing, "overflow") for _ in range(4)]
        clean = pool.submit(_complete, client, victim, BASE)
        responses = [f.result() for f in evil]
        victim_response = clean.result()
    for r in responses:
        assert r.status_code == 400, r.text
        _assert_named_error(r.json()["error"])
    assert victim_response.status_code == 200, victim_response.text
    assert victim_response.json()["choices"][0]["finish_reason"] == "length"


def test_overflowing_adapter_ends_its_stream_with_the_named_error(
    client: TestClient, overflowing: dict[str, str]
) -> None:
    with client.stream(
        "POST",
        "/v1/completions",
        headers=overflowing,
        json={"model": "overflow", "prompt": "hello", "max_tokens": 8, "ignore_eos": True, "stream": True},
    ) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert len(errors) == 1, events
    _assert_named_error(errors[0])
