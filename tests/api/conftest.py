"""The API tests' in-process app: a console-enabled app per test module (the real servers they share
are `tests.harness.shared_server`'s `server` fixture)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI

from api.state import AppState
from tests.api.admin import console_helpers


@pytest.fixture(scope="module")
def app_state(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[FastAPI, AppState]]:
    """A console-enabled app in process, one per test module (the console tests' app)."""
    with console_helpers.console_app(tiny_llama_dir, tmp_path_factory.mktemp("console")) as started:
        yield started


@pytest.fixture
def app(app_state: tuple[FastAPI, AppState]) -> FastAPI:
    return app_state[0]
