"""An engine that cannot go on says so: /health and /ready answer 503 instead of hanging requests."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.bootstrap import build_state
from api.settings import Settings
from base_engine.async_engine import MAX_CONSECUTIVE_FAILURES


@pytest.fixture(scope="module")
def settings(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    data_dir = tmp_path_factory.mktemp("health")
    return Settings(
        model=tiny_llama_dir, data_dir=data_dir, admin_key="lsa-health", num_kv_blocks=64, max_model_len=128
    )


def test_failing_engine_turns_health_and_ready_503(settings: Settings) -> None:
    state = build_state(settings)
    with TestClient(create_app(state)) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/ready").status_code == 200
        state.engine.num_consecutive_failures = MAX_CONSECUTIVE_FAILURES  # as after repeated step failures
        for path in ("/health", "/ready"):
            response = client.get(path)
            assert response.status_code == 503, path
            assert "engine" in response.json()["error"]["message"]
        state.engine.num_consecutive_failures = 0  # a good step resets it
        assert client.get("/health").status_code == 200
