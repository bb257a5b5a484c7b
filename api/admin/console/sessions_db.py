"""Console sessions of a fleet: the same sessions as api/admin/console/sessions.py, kept in the database.

Any replica serves a login made through another, and a replica's restart keeps it. The table holds
only the sha256 of the cookie's id (a database reader cannot sign in with what it reads) next to the
session's CSRF token; expiry is the in-memory store's (`idle_s` since the last request, `max_age_s`
in all), on wall-clock epoch seconds because replicas share no monotonic clock. Flash messages stay
in the replica that set them (they are shown by the redirect that follows an action, which a sticky
or lucky load balancer sends to the same replica; elsewhere the outcome is visible on the page).
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Callable

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session, sessionmaker

from api.admin.console.sessions import ConsoleSession, SessionStore
from registry.fleet_state_models import ConsoleSessionRow


def hash_session_id(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


class DbSessionStore(SessionStore):
    """`SessionStore`'s interface on `console_sessions`; each call is one short transaction."""

    def __init__(
        self,
        sessions: sessionmaker[Session],
        *,
        idle_s: float = 8 * 3600.0,
        max_age_s: float = 24 * 3600.0,
        max_sessions: int = 1000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(idle_s=idle_s, max_age_s=max_age_s, max_sessions=max_sessions, clock=clock)
        self.db = sessions
        self._flashes: dict[str, list[tuple[str, str]]] = {}  # id hash -> this replica's flashes
        self._flash_lock = threading.Lock()

    def __len__(self) -> int:
        with self.db() as db:
            return int(db.scalar(select(func.count()).select_from(ConsoleSessionRow)) or 0)

    def create(self) -> ConsoleSession:
        now = self.clock()
        session = ConsoleSession(
            id=secrets.token_urlsafe(32), csrf_token=secrets.token_urlsafe(32), created_at=now, last_seen=now
        )
        with self.db() as db, db.begin():
            db.execute(delete(ConsoleSessionRow).where(self._expired(now)))
            excess = (
                int(db.scalar(select(func.count()).select_from(ConsoleSessionRow)) or 0)
                - self.max_sessions
                + 1
            )
            if excess > 0:  # drop the oldest logins
                oldest = (
                    select(ConsoleSessionRow.id_hash).order_by(ConsoleSessionRow.created_at).limit(excess)
                )
                db.execute(
                    delete(ConsoleSessionRow).where(ConsoleSessionRow.id_hash.in_(oldest.scalar_subquery()))
                )
            db.add(
                ConsoleSessionRow(
                    id_hash=hash_session_id(session.id),
                    csrf_token=session.csrf_token,
                    created_at=now,
                    last_seen=now,
                )
            )
        session.flashes = self._flash_list(hash_session_id(session.id))
        return session

    def get(self, session_id: str | None) -> ConsoleSession | None:
        """The live session with this id (touching it), or None when unknown or expired."""
        if not session_id:
            return None
        now, id_hash = self.clock(), hash_session_id(session_id)
        with self.db() as db, db.begin():
            row = db.get(ConsoleSessionRow, id_hash, with_for_update=True)
            if row is None:
                return None
            if now - row.last_seen > self.idle_s or now - row.created_at > self.max_age_s:
                db.delete(row)
                self._forget(id_hash)
                return None
            row.last_seen = now
            return ConsoleSession(
                id=session_id,
                csrf_token=row.csrf_token,
                created_at=row.created_at,
                last_seen=now,
                flashes=self._flash_list(id_hash),
            )

    def drop(self, session_id: str | None) -> None:
        if not session_id:
            return
        id_hash = hash_session_id(session_id)
        with self.db() as db, db.begin():
            db.execute(delete(ConsoleSessionRow).where(ConsoleSessionRow.id_hash == id_hash))
        self._forget(id_hash)

    def _expired(self, now: float):  # noqa: ANN202 - a SQL condition
        return (ConsoleSessionRow.last_seen < now - self.idle_s) | (
            ConsoleSessionRow.created_at < now - self.max_age_s
        )

    def _flash_list(self, id_hash: str) -> list[tuple[str, str]]:
        with self._flash_lock:
            flashes = self._flashes.setdefault(id_hash, [])
            while len(self._flashes) > self.max_sessions:  # sessions that expired elsewhere: oldest first
                self._flashes.pop(next(iter(self._flashes)))
            return flashes

    def _forget(self, id_hash: str) -> None:
        with self._flash_lock:
            self._flashes.pop(id_hash, None)


def open_session_store(sessions: sessionmaker[Session], *, fleet: bool) -> SessionStore:
    """The fleet's sessions live in the database; a single process keeps them in memory."""
    return DbSessionStore(sessions) if fleet else SessionStore()
