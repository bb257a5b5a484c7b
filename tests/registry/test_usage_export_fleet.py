"""The usage export with several writers on PostgreSQL: every row exactly once.

A fleet's replicas each flush usage in their own transactions, so a row with a lower id can commit
after a reader has paged past higher ids. The export's (txid, id) order below the oldest running
transaction (registry/usage.py) must neither skip such a row nor hand any row out twice.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import pytest
from sqlalchemy.orm import Session, sessionmaker

from migrations.api import upgrade
from registry.db import make_engine, session_factory
from registry.usage import export_usage, write_usage
from tests.harness.usage import random_records


@pytest.fixture
def sessions(postgres_db_url: str) -> Iterator[sessionmaker[Session]]:
    upgrade(postgres_db_url)
    engine = make_engine(postgres_db_url)
    yield session_factory(engine)
    engine.dispose()


def _drain(sessions: sessionmaker[Session], cursor: str | None, seen: list[str]) -> str | None:
    while True:
        with sessions() as s:
            page = export_usage(s, cursor=cursor, limit=3)
        seen += [r.request_id for r in page.records]
        cursor = page.next_cursor
        if not page.has_more:
            return cursor


def test_a_lower_id_committed_late_is_exported_once(sessions: sessionmaker[Session]) -> None:
    records = random_records(8, seed=11)
    slow = sessions()
    write_usage.__wrapped__(slow, records[:1])  # type: ignore[attr-defined]  # takes the lowest id, stays open
    with sessions() as s:
        write_usage(s, records[1:5])  # higher ids, committed first
    seen: list[str] = []
    cursor = _drain(sessions, None, seen)
    assert seen == []  # the open transaction holds the export back: nothing after it may come first
    slow.commit()
    slow.close()
    with sessions() as s:
        write_usage(s, records[5:])
    cursor = _drain(sessions, cursor, seen)
    assert sorted(seen) == sorted(r.request_id for r in records)  # each exactly once
    assert seen[0] == records[0].request_id  # in commit-safe order: the slow writer's row first
    assert _drain(sessions, cursor, []) == cursor


def test_concurrent_writers_and_a_paging_reader_see_every_row_once(sessions: sessionmaker[Session]) -> None:
    records = random_records(120, seed=12)
    chunks = [records[i : i + 4] for i in range(0, len(records), 4)]
    rng = random.Random(5)
    holds = [rng.choice([0.0, 0.0, 0.02, 0.08]) for _ in chunks]
    lock = threading.Lock()

    def writer(index: int) -> None:
        while True:
            with lock:
                if not chunks:
                    return
                chunk, hold = chunks.pop(), holds.pop()
            session = sessions()
            try:
                write_usage.__wrapped__(session, chunk)  # type: ignore[attr-defined]
                time.sleep(hold)  # commit out of id order
                session.commit()
            finally:
                session.close()

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    seen: list[str] = []
    cursor = None
    while any(t.is_alive() for t in threads):
        cursor = _drain(sessions, cursor, seen)
    for t in threads:
        t.join()
    _drain(sessions, cursor, seen)
    assert len(seen) == len(set(seen)) == len(records)
    assert set(seen) == {r.request_id for r in records}
