"""A Gemma3ForConditionalGeneration checkpoint is served as its text model: startup says in one log line
that the vision tower was not loaded (and, in another, which layers slide), and /v1/models says so on
the base model's card."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.bootstrap import build_state
from api.settings import Settings
from tests.harness.families import CHECKPOINTS

ADMIN = "lsa-vision-test-admin-key"


def test_models_card_and_log_say_the_vision_tower_is_not_loaded(
    make_checkpoint, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model_dir: Path = make_checkpoint(**CHECKPOINTS["gemma3-vision"])
    settings = Settings(model=model_dir, data_dir=tmp_path / "data", admin_key=ADMIN, max_model_len=128,
                        num_kv_blocks=32)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="base_engine"):
        state = build_state(settings)
    lines = [r.getMessage() for r in caplog.records if "vision-tower tensors not loaded" in r.getMessage()]
    assert len(lines) == 1 and str(model_dir) in lines[0]
    assert any("sliding window 6 on 5 of 6 layers" in r.getMessage() for r in caplog.records)
    with TestClient(create_app(state), base_url="http://127.0.0.1:8000") as client:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        tenant = client.post("/admin/api/tenants", json={"name": "vision"}, headers=admin)
        assert tenant.status_code == 201, tenant.text
        key = tenant.json()["api_key"]
        models = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert models.status_code == 200, models.text
        base = models.json()["data"][0]
        assert base["id"] == state.model_name and "not loaded" in base["vision_tower"]
        completion = client.post(
            "/v1/completions",
            json={"model": state.model_name, "prompt": "Hello", "max_tokens": 3},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert completion.status_code == 200, completion.text
