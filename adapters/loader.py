"""Background adapter loads for the cache's host tier: fetch, then parse and validate, in small pools.

Two pools, so that an adapter already on local disk never waits behind a remote fetch:
- parse pool (`num_parse_workers`): asks `fetch.local_path(ref)` (when the fetch offers it: the
  registry's disk tier, or an offline directory) and parses a local hit at once;
- fetch pool (`num_fetch_workers`): remote fetches, whose result goes back to the parse pool.
A load that has not finished after `deadline_s` counts as failed (a hung fetch's thread is left to
finish on its own; its late result is dropped).

Failures: an adapter that can never be served (`AdapterFormatError`: format, validation, limits) stays
refused; anything else (store unreachable, timeout, a download that failed verification) is retried
with exponential backoff, 2 s after the first failure doubling to at most 60 s, so one S3 blip does
not fail an adapter until a restart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from adapters.format import LoraAdapter
from adapters.types import AdapterFormatError, AdapterRef

logger = logging.getLogger(__name__)

Fetch = Callable[[AdapterRef], Path]
LocalPath = Callable[[AdapterRef], Path | None]

RETRY_UNREACHABLE_S = 2.0  # first retry after a transient failure
MAX_RETRY_S = 60.0
DEFAULT_DEADLINE_S = 120.0


@dataclass(frozen=True, slots=True)
class LoadFailure:
    message: str
    retry_at: float | None  # monotonic time from which a new load is tried; None = never


@dataclass(slots=True)
class PendingLoad:
    future: Future[LoraAdapter]
    started: float = field(default_factory=time.monotonic)


def backoff_s(num_failures: int) -> float:
    """1 -> 2 s, 2 -> 4 s, 3 -> 8 s, ... capped at 60 s."""
    return min(MAX_RETRY_S, RETRY_UNREACHABLE_S * 2.0 ** (num_failures - 1))


class AdapterLoader:
    def __init__(
        self,
        fetch: Fetch,
        parse: Callable[[Path], LoraAdapter],
        *,
        num_fetch_workers: int = 4,
        num_parse_workers: int = 2,
        deadline_s: float = DEFAULT_DEADLINE_S,
    ) -> None:
        self.fetch = fetch
        self.local_path: LocalPath | None = getattr(fetch, "local_path", None)
        self.parse = parse
        self.deadline_s = deadline_s
        self.pending: dict[str, PendingLoad] = {}  # ref.id -> load in flight
        self.failed: dict[str, LoadFailure] = {}  # ref.id -> why it cannot be served (now)
        self.num_failures: dict[str, int] = {}  # ref.id -> transient failures in a row
        self._parse_pool = ThreadPoolExecutor(num_parse_workers, thread_name_prefix="adapter-parse")
        self._fetch_pool = ThreadPoolExecutor(num_fetch_workers, thread_name_prefix="adapter-fetch")

    def error(self, ref: AdapterRef) -> str | None:
        """Why `ref` cannot be served now; None also when a transient failure's pause is over, or
        when its files have reached local disk meanwhile (fetched for the API: nothing to wait for)."""
        failure = self.failed.get(ref.id)
        if failure is None or self._may_retry(failure) or self._is_local_now(ref, failure):
            return None
        return failure.message

    def retry_after_s(self, ref: AdapterRef) -> float | None:
        """Seconds until `ref` is tried again after a transient failure (None: not failed or never)."""
        failure = self.failed.get(ref.id)
        if failure is None or failure.retry_at is None:
            return None
        return max(0.0, failure.retry_at - time.monotonic())

    def start(self, ref: AdapterRef) -> None:
        """Start loading `ref` unless it is loading or refused (for now). Never blocks."""
        if ref.id in self.pending:
            return
        failure = self.failed.get(ref.id)
        if failure is not None and not (self._may_retry(failure) or self._is_local_now(ref, failure)):
            return
        self.failed.pop(ref.id, None)
        future: Future[LoraAdapter] = Future()
        self.pending[ref.id] = PendingLoad(future)
        self._parse_pool.submit(self._local_stage, ref, future)

    def forget(self, ref: AdapterRef) -> None:
        """An operator asked again (pin): try now whatever failed before."""
        self.failed.pop(ref.id, None)
        self.num_failures.pop(ref.id, None)

    def poll(self) -> tuple[list[tuple[str, LoraAdapter, float]], list[tuple[str, str]]]:
        """(ref id, adapter, seconds) of finished loads and (ref id, message) of failed ones."""
        done: list[tuple[str, LoraAdapter, float]] = []
        failures: list[tuple[str, str]] = []
        now = time.monotonic()
        for ref_id, pending in list(self.pending.items()):
            if not pending.future.done():
                if now - pending.started > self.deadline_s:
                    del self.pending[ref_id]
                    exc = TimeoutError(f"loading did not finish within {self.deadline_s:g} s")
                    failures.append((ref_id, self._record_failure(ref_id, exc)))
                continue
            del self.pending[ref_id]
            exc = pending.future.exception()
            if exc is not None:
                failures.append((ref_id, self._record_failure(ref_id, exc)))
                continue
            self.num_failures.pop(ref_id, None)
            done.append((ref_id, pending.future.result(), now - pending.started))
        return done, failures

    def shutdown(self) -> None:
        self._parse_pool.shutdown(wait=False, cancel_futures=True)
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)

    # ---- internals ----------------------------------------------------------------------------

    @staticmethod
    def _may_retry(failure: LoadFailure) -> bool:
        return failure.retry_at is not None and time.monotonic() >= failure.retry_at

    def _is_local_now(self, ref: AdapterRef, failure: LoadFailure) -> bool:
        # Only a transient failure asks the disk (called from the engine thread: no stat for refusals).
        if failure.retry_at is None or self.local_path is None:
            return False
        return self.local_path(ref) is not None

    def _record_failure(self, ref_id: str, exc: BaseException) -> str:
        message = f"adapter {ref_id!r} cannot be served: {exc}"
        if isinstance(exc, AdapterFormatError):
            self.failed[ref_id] = LoadFailure(message, None)
            return message
        count = self.num_failures.get(ref_id, 0) + 1
        self.num_failures[ref_id] = count
        delay = backoff_s(count)
        logger.warning(
            "adapter %s: load failed (%d in a row), retried after %.0f s: %s", ref_id, count, delay, exc
        )
        self.failed[ref_id] = LoadFailure(message, time.monotonic() + delay)
        return message

    def _local_stage(self, ref: AdapterRef, future: Future[LoraAdapter]) -> None:
        try:
            path = self.local_path(ref) if self.local_path is not None else None
            if path is None:
                self._fetch_pool.submit(self._remote_stage, ref, future)
                return
            _resolve(future, self.parse(path))
        except BaseException as exc:  # noqa: BLE001 - handed to poll() through the future
            _fail(future, exc)

    def _remote_stage(self, ref: AdapterRef, future: Future[LoraAdapter]) -> None:
        try:
            path = self.fetch(ref)
            self._parse_pool.submit(self._parse_stage, path, future)
        except BaseException as exc:  # noqa: BLE001
            _fail(future, exc)

    def _parse_stage(self, path: Path, future: Future[LoraAdapter]) -> None:
        try:
            _resolve(future, self.parse(path))
        except BaseException as exc:  # noqa: BLE001
            _fail(future, exc)


def _resolve(future: Future[LoraAdapter], value: LoraAdapter) -> None:
    try:
        future.set_result(value)
    except InvalidStateError:  # abandoned after its deadline
        pass


def _fail(future: Future[LoraAdapter], exc: BaseException) -> None:
    try:
        future.set_exception(exc)
    except InvalidStateError:
        pass
