"""Usage records for the metering and registry tests: fixed ones (`record(i)`), random ones, a meter's
`begin` from a record, the stored rows read back, and a tenant's records through the admin export.

`sqlite_session` (function fixture, a plugin of tests/conftest.py): sessions on a migrated SQLite
database of the test's own.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.orm import Session

from api.metering.meter import UsageMeter
from migrations.api import upgrade
from registry.db import make_engine, session_factory
from registry.usage import UsageRecord, export_usage
from tests.harness.servers import ADMIN_KEY

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
RANDOM_T0 = datetime(2026, 11, 28, 22, 0, tzinfo=UTC)
REPO_ROOT = Path(__file__).resolve().parents[2]  # where a child Python finds `tests.harness`


@pytest.fixture
def sqlite_session(tmp_path: Path) -> Iterator[Callable[[], Session]]:
    url = f"sqlite:///{tmp_path / 'usage.db'}"
    upgrade(url)
    engine = make_engine(url)
    try:
        yield session_factory(engine)
    finally:
        engine.dispose()


def record(i: int, **changes: object) -> UsageRecord:
    fields: dict[str, object] = {
        "request_id": f"req-{i}",
        "tenant_id": "ta" if i % 2 else "tb",
        "key_prefix": "kkkkkkkkkkkk",
        "adapter_name": "bot" if i % 3 else None,
        "adapter_version": 2 if i % 3 else None,
        "prompt_tokens": 10 + i,
        "cached_prompt_tokens": i % 5,
        "completion_tokens": 3 * i,
        "finish_reason": "stop",
        "queue_time_s": 0.01 * i,
        "ttft_s": 0.1,
        "total_time_s": 1.0 + i,
        "created_at": T0 + timedelta(seconds=i),
        "finished_at": T0 + timedelta(seconds=i + 1),
    }
    fields.update(changes)
    return UsageRecord(**fields)  # type: ignore[arg-type]


def random_records(n: int, seed: int = 0) -> list[UsageRecord]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = rng.randint(1, 500)
        adapter = rng.choice([None, ("bot", 1), ("bot", 2), ("sql", 1)])
        finished = RANDOM_T0 + timedelta(minutes=rng.randint(0, 60 * 30))  # spans three UTC days
        out.append(
            UsageRecord(
                request_id=f"req-{seed}-{i}",
                tenant_id=rng.choice(["ta", "tb"]),
                key_prefix=rng.choice(["aaaaaaaaaaaa", "bbbbbbbbbbbb", None]),
                adapter_name=adapter[0] if adapter else None,
                adapter_version=adapter[1] if adapter else None,
                prompt_tokens=prompt,
                cached_prompt_tokens=rng.randint(0, prompt),
                completion_tokens=rng.randint(0, 300),
                finish_reason=rng.choice(["stop", "length", "abort"]),
                queue_time_s=rng.random(),
                ttft_s=rng.choice([None, rng.random()]),
                total_time_s=1 + rng.random(),
                created_at=finished - timedelta(seconds=2),
                finished_at=finished,
            )
        )
    return out


def stored(make_session: Callable[[], Session]) -> dict[str, UsageRecord]:
    with make_session() as session:
        rows = export_usage(session, limit=10_000).records
    assert len({r.request_id for r in rows}) == len(rows)
    return {r.request_id: r for r in rows}


def begin(meter: UsageMeter, r: UsageRecord) -> None:
    meter.begin(
        r.request_id,
        tenant_id=r.tenant_id,
        key_prefix=r.key_prefix,
        prompt_tokens=r.prompt_tokens,
        adapter_name=r.adapter_name,
        adapter_version=r.adapter_version,
        created_at=r.created_at,
    )


def export(base_url: str, tenant_id: str, admin_key: str = ADMIN_KEY) -> list[dict[str, Any]]:
    """Every record of a tenant through the admin export, following the cursor."""
    events, cursor = [], None
    while True:
        params = {"tenant_id": tenant_id, "limit": 7, **({"cursor": cursor} if cursor else {})}
        r = httpx.get(
            f"{base_url}/admin/api/usage/export",
            params=params,
            headers={"Authorization": f"Bearer {admin_key}"},
            timeout=60,
        )
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson", r.text
        events += [json.loads(line) for line in r.text.splitlines()]
        cursor = r.headers.get("x-next-cursor")
        if r.headers["x-has-more"] == "false":
            return [e["data"] for e in events]
