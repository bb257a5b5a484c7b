"""Console sessions in the database (api/admin/console/sessions_db.py): shared, hashed, expiring as in
memory."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.admin.console.sessions_db import DbSessionStore, hash_session_id
from registry.fleet_state_models import ConsoleSessionRow
from tests.harness.clock import FakeClock


def test_sessions_are_shared_hashed_and_expire(make_session: Callable[[], Session]) -> None:
    clock = FakeClock()
    a = DbSessionStore(make_session, idle_s=60, max_age_s=300, max_sessions=2, clock=clock)  # type: ignore[arg-type]
    b = DbSessionStore(make_session, idle_s=60, max_age_s=300, max_sessions=2, clock=clock)  # type: ignore[arg-type]
    login = a.create()
    seen = b.get(login.id)  # another replica
    assert seen is not None and seen.csrf_token == login.csrf_token and seen.csrf_matches(login.csrf_token)
    with make_session() as db:
        stored = db.scalars(select(ConsoleSessionRow.id_hash)).all()
    assert stored == [hash_session_id(login.id)] and login.id not in stored  # only the hash is kept
    for _ in range(5):  # each request within idle_s keeps it alive
        clock.now += 50
        assert b.get(login.id) is not None
    clock.now += 61
    assert a.get(login.id) is None  # idle too long
    first, second = a.create(), a.create()
    clock.now += 1
    third = b.create()  # max_sessions=2: the oldest login goes
    assert a.get(first.id) is None and a.get(second.id) is not None and b.get(third.id) is not None
    for _ in range(6):
        clock.now += 50
        b.get(second.id)
    assert b.get(second.id) is None  # 300 s in all, however active
    b.drop(third.id)
    assert a.get(third.id) is None and a.get("") is None and a.get("unknown") is None


def test_flashes_shown_once_on_the_replica_that_set_them(make_session: Callable[[], Session]) -> None:
    store = DbSessionStore(make_session)  # type: ignore[arg-type]
    login = store.create()
    session = store.get(login.id)
    assert session is not None
    session.flash("ok", "tenant created")
    again = store.get(login.id)
    assert again is not None and again.pop_flashes() == [("ok", "tenant created")]
    assert store.get(login.id).pop_flashes() == []  # type: ignore[union-attr]
