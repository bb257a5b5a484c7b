"""A child process of test_fleet_state_start: `loraserve db upgrade`'s call, racing another one.

Kept apart from the test module so that a spawned child imports only the registry (not torch). The
`slow` child pauses in the middle of its migration (after creating alembic_version, before the
first registry table) and tells the other child to start then: without a lock around migrations the
second one would collide with the first's uncommitted tables.
"""

from __future__ import annotations

import time
from typing import Any

PAUSE_S = 3.0


def upgrade_racing(url: str, slow: bool, midway: Any, results: Any) -> None:
    from sqlalchemy import Engine, event

    from migrations.api import upgrade

    if slow:

        def pause(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            if statement.lstrip().startswith("CREATE TABLE tenants"):
                midway.set()
                time.sleep(PAUSE_S)

        event.listen(Engine, "before_cursor_execute", pause)
    else:
        midway.wait(timeout=120)
    try:
        upgrade(url)
        results.put("ok")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put(repr(exc)[:500])
