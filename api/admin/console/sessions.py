"""Server-side console sessions: an opaque random id in the cookie, everything else kept here.

Follows the OWASP Session Management and CSRF Prevention cheat sheets: the cookie carries only a
256-bit random id (HttpOnly, SameSite=Strict, Path=/admin, Secure over https); the session's CSRF
token (synchronizer-token pattern) and flash messages stay in server memory. A new id is issued at
every login (no fixation) and dropped at logout. Sessions end after `idle_s` without a request or
`max_age_s` in all; a server restart ends them all (operators log in again). A fleet keeps them in
the database instead (api/admin/console/sessions_db.py: any replica serves them, restarts keep them).
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

COOKIE_NAME = "loraserve_console"
COOKIE_PATH = "/admin"


@dataclass
class ConsoleSession:
    id: str
    csrf_token: str
    created_at: float  # monotonic seconds
    last_seen: float
    flashes: list[tuple[str, str]] = field(default_factory=list)  # (level "ok" | "error", message)

    def flash(self, level: str, message: str) -> None:
        self.flashes.append((level, message))

    def pop_flashes(self) -> list[tuple[str, str]]:
        # Emptied in place: the database store hands out the same list for every copy of a session.
        flashes = list(self.flashes)
        self.flashes.clear()
        return flashes

    def csrf_matches(self, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token.encode(), self.csrf_token.encode())


class SessionStore:
    """Thread-safe id -> session map with idle and absolute expiry, bounded in size."""

    def __init__(
        self,
        *,
        idle_s: float = 8 * 3600.0,
        max_age_s: float = 24 * 3600.0,
        max_sessions: int = 1000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if idle_s <= 0 or max_age_s <= 0 or max_sessions < 1:
            raise ValueError(f"need idle_s > 0, max_age_s > 0, max_sessions >= 1, got {idle_s=}, "
                             f"{max_age_s=}, {max_sessions=}")  # fmt: skip
        self.idle_s = idle_s
        self.max_age_s = max_age_s
        self.max_sessions = max_sessions
        self.clock = clock
        self._sessions: dict[str, ConsoleSession] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self) -> ConsoleSession:
        now = self.clock()
        session = ConsoleSession(
            id=secrets.token_urlsafe(32), csrf_token=secrets.token_urlsafe(32), created_at=now, last_seen=now
        )
        with self._lock:
            self._expire(now)
            while len(self._sessions) >= self.max_sessions:
                # Dicts keep insertion order: drop the oldest login.
                self._sessions.pop(next(iter(self._sessions)))
            self._sessions[session.id] = session
        return session

    def get(self, session_id: str | None) -> ConsoleSession | None:
        """The live session with this id (touching it), or None when unknown or expired."""
        if not session_id:
            return None
        now = self.clock()
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return None
            if self._is_expired(session, now):
                del self._sessions[session_id]
                return None
            session.last_seen = now
            return session

    def drop(self, session_id: str | None) -> None:
        with self._lock:
            self._sessions.pop(session_id or "", None)

    def _is_expired(self, session: ConsoleSession, now: float) -> bool:
        return now - session.last_seen > self.idle_s or now - session.created_at > self.max_age_s

    def _expire(self, now: float) -> None:
        for session_id in [s.id for s in self._sessions.values() if self._is_expired(s, now)]:
            del self._sessions[session_id]
