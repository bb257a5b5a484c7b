"""Registry test fixtures: a migrated database session, an object store, and `validate` (the real
`adapters.validation.validate_adapter` on the shapes `tests.harness.raw_adapters` writes for)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from adapters.types import AdapterSummary
from adapters.validation import validate_adapter
from registry.store import ObjectStore
from registry.stores import open_store
from tests.harness.raw_adapters import SHAPES

MAX_RANK = 16


@pytest.fixture
def validate() -> Callable[[Path], AdapterSummary]:
    return functools.partial(validate_adapter, base=SHAPES, max_lora_rank=MAX_RANK, max_size_bytes=1 << 20)


@pytest.fixture
def session(make_session: Callable[[], Session]) -> Iterator[Session]:
    with make_session() as s:
        yield s


@pytest.fixture
def local_store(tmp_path: Path) -> ObjectStore:
    return open_store((tmp_path / "objects").as_uri())


@pytest.fixture
def store(store_url: str) -> ObjectStore:
    """LocalStore and S3Store (moto server); the tests run once per backend."""
    return open_store(store_url, max_attempts=2)
