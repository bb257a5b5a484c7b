"""Is this bearer token a key the registry issued? Answered before a request's body is read.

A forged key must cost the server neither the parse of its body (api/http/key_guard.py asks here
first) nor one database query per request. So:
- a malformed token is refused without the database (`registry.keys.key_prefix`);
- a well-formed one is looked up once (`registry.keys.check_issued`: the row and the digest, not
  revocation or the tenant's status, which the route's own authentication decides exactly); the
  verdict is remembered by sha256 of the token in a bounded LRU (`max_entries`), for good: a key
  that was never issued never becomes one, and an issued key stays issued (revoked keys pass here
  and get their 401 from the route);
- concurrent requests with the same unknown token share one lookup, and lookups run in a pool of
  their own (`pool`: its size bounds how many queries forged keys can have in flight), never on
  the event loop. A lookup without an answer within `timeout_s` (a database outage) lets the request
  on to the route, which answers it as it always did (503 `database_unavailable`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from sqlalchemy.orm import Session

from registry.errors import AuthError
from registry.keys import check_issued, key_prefix

logger = logging.getLogger(__name__)

_ISSUED = ""  # the memo's verdict for an issued key (else the refusal's message)


class KeyPrecheck:
    def __init__(
        self,
        *,
        sessions: Callable[[], Session],
        pool: ThreadPoolExecutor,
        timeout_s: float,
        max_entries: int = 16384,
    ) -> None:
        self._sessions = sessions
        self._pool = pool
        self.timeout_s = timeout_s
        self.max_entries = max_entries
        self._verdicts: OrderedDict[bytes, str] = OrderedDict()  # token digest -> "" or refusal
        self._pending: dict[bytes, asyncio.Future[str]] = {}
        self.num_lookups = 0  # database lookups made (each distinct well-formed token once)

    async def refusal(self, token: str) -> str | None:
        """Why `token` is no key of this registry (AuthError's message), or None: issued, or no
        answer in time (the route decides)."""
        try:
            key_prefix(token)
        except AuthError as exc:
            return str(exc)
        digest = hashlib.sha256(token.encode()).digest()
        verdict = self._verdicts.get(digest)
        if verdict is not None:
            self._verdicts.move_to_end(digest)
            return verdict or None
        pending = self._pending.get(digest)
        if pending is None or pending.get_loop() is not asyncio.get_running_loop():
            pending = asyncio.ensure_future(self._look_up(digest, token))
            pending.add_done_callback(_retrieve)  # a failure nobody waits for any more is not logged twice
            self._pending[digest] = pending
        try:
            verdict = await asyncio.wait_for(asyncio.shield(pending), self.timeout_s)
        except TimeoutError:
            return None
        except Exception:  # noqa: BLE001 - the database failed: the route's own check answers
            return None
        return verdict or None

    async def _look_up(self, digest: bytes, token: str) -> str:
        try:
            self.num_lookups += 1
            verdict = await asyncio.wrap_future(self._pool.submit(self._check, token))
        except Exception:
            logger.warning("key precheck lookup failed; the route authenticates", exc_info=True)
            raise
        finally:
            if self._pending.get(digest) is asyncio.current_task():
                del self._pending[digest]
        self._verdicts[digest] = verdict
        if len(self._verdicts) > self.max_entries:
            self._verdicts.popitem(last=False)
        return verdict

    def _check(self, token: str) -> str:
        """In the pool: "" when the registry issued `token`, else the refusal's message."""
        with self._sessions() as session:
            try:
                check_issued(session, api_key=token)
            except AuthError as exc:
                return str(exc)
        return _ISSUED


def _retrieve(future: asyncio.Future[str]) -> None:
    if not future.cancelled():
        future.exception()
