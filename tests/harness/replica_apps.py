"""Several replicas' real apps in one process, on one event loop and one SQLite registry, with their
lifespans entered (the fleet tests that need no Ray: tests/api/fleet/)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from api.app import create_app
from api.bootstrap import build_state
from api.settings import Settings
from api.state import AppState


@dataclass
class ReplicaApp:
    name: str
    state: AppState
    app: object


@contextmanager
def replica_apps(
    loop: asyncio.AbstractEventLoop, tmp: Path, names: tuple[str, ...], **settings: object
) -> Iterator[list[ReplicaApp]]:
    """One app per name (data under tmp/<name>, the registry database shared), exited in reverse."""
    db = f"sqlite:///{tmp / 'fleet.db'}"
    replicas, lifespans = [], []
    try:
        for name in names:
            state = build_state(Settings(data_dir=tmp / name, db=db, **settings))
            app = create_app(state)
            lifespan = app.router.lifespan_context(app)
            loop.run_until_complete(lifespan.__aenter__())
            lifespans.append(lifespan)
            replicas.append(ReplicaApp(name, state, app))
        yield replicas
    finally:
        for lifespan in reversed(lifespans):
            loop.run_until_complete(lifespan.__aexit__(None, None, None))
