"""The app's lifespan ends what it started: the engine's adapter loader threads and the registry
database's pooled connections."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.bootstrap import build_state
from api.settings import Settings


def test_lifespan_end_closes_the_engine_and_disposes_the_database(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(
        model=tiny_llama_dir, data_dir=tmp_path, admin_key="lsa-cleanup", num_kv_blocks=64, max_model_len=128
    )
    state = build_state(settings)
    loader = state.engine.engine.lora.cache.loader
    database = state.sessions.kw["bind"]
    disposed: list[bool] = []
    real_dispose = database.dispose
    monkeypatch.setattr(database, "dispose", lambda *a, **k: (disposed.append(True), real_dispose(*a, **k)))
    with TestClient(create_app(state)) as client:
        assert client.get("/health").status_code == 200
        assert not loader._parse_pool._shutdown and not loader._fetch_pool._shutdown
        assert disposed == []
    assert loader._parse_pool._shutdown and loader._fetch_pool._shutdown
    assert disposed == [True]
