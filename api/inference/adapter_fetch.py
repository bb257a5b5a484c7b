"""The engine's `fetch(ref) -> local dir`: the disk tier, with object-store outages told apart.

Two callers fetch an adapter's files into the disk tier (registry/disk_cache.py, which downloads
each version once however many ask):
- the API, before admitting a request for an adapter the engine does not hold (`ensure_local`): an
  adapter already in the disk tier returns at once, never queueing behind downloads; a download runs
  in a small pool of its own and is waited for at most `wait_s` (`adapter_fetch_wait_s`), so an
  unreachable or hung object store is a retryable 503 before any 200, for streams too, within that
  bound (the download goes on, and a retry finds the files local), and no admission slot is held
  while the files download;
- the engine's adapter cache (adapters/cache.py, adapters/loader.py), which loads in the background
  through `fetch` and fails the requests waiting for an adapter whose load failed (and tries again
  after a pause, at once when the files have reached the disk tier meanwhile). There, an
  unreachable store raises `StoreUnreachable` (a ConnectionError) and is noted, so that the API
  answers those requests with the same retryable 503 rather than a 500 (`adapter_unavailable`).
The store's own message (endpoint, bucket, key) goes to the log only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from adapters.loader import RETRY_UNREACHABLE_S
from adapters.types import AdapterRef
from api.errors import APIError
from registry.disk_cache import DiskTier
from registry.errors import StoreUnavailable

logger = logging.getLogger(__name__)

RETRY_AFTER_S = max(1, round(RETRY_UNREACHABLE_S))  # what the 503 tells clients to wait
_FETCH_THREADS = 4  # downloads the API waits for at once; a hung store pins these, nothing else


class StoreUnreachable(ConnectionError):
    """The adapter's files are neither local nor fetchable now; a later try may succeed."""


class AdapterFetch:
    def __init__(self, disk: DiskTier, *, wait_s: float) -> None:
        if wait_s <= 0:
            raise ValueError(f"wait_s must be > 0, got {wait_s}")
        self.disk = disk
        self.wait_s = wait_s  # longest a request waits for a download (queue included)
        self._unreachable: set[str] = set()  # ref ids whose last fetch met an unreachable store
        self._fetching: dict[str, Future[Path]] = {}  # ref id -> the API's download in progress
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=_FETCH_THREADS, thread_name_prefix="adapter-fetch")

    def __call__(self, ref: AdapterRef) -> Path:
        try:
            path = self.disk.fetch(ref)
        except StoreUnavailable as exc:
            logger.warning("adapter %s cannot be fetched now: %s", ref.id, exc)
            with self._lock:
                self._unreachable.add(ref.id)
            raise StoreUnreachable("the object store holding the adapter cannot be reached") from exc
        except BaseException:
            self._forget(ref.id)
            raise
        self._forget(ref.id)
        return path

    def local_path(self, ref: AdapterRef) -> Path | None:
        """Already in the disk tier: the engine's loader parses it without queueing behind fetches."""
        return self.disk.local_path(ref)

    async def ensure_local(self, ref: AdapterRef) -> None:
        """Have `ref`'s files in the disk tier (at once when they are); concurrent callers for one
        adapter share one download. Raises StoreUnreachable (also when the download, queue included,
        is not done within `wait_s`), or the disk tier's other errors."""
        if self.disk.local_path(ref) is not None:  # a dict lookup and one stat: no pool, no queue
            return
        with self._lock:
            future = self._fetching.get(ref.id)
            if future is None:
                future = self._pool.submit(self, ref)
                self._fetching[ref.id] = future
                future.add_done_callback(lambda _, ref_id=ref.id: self._done(ref_id))
        # Shielded: one caller going away (a disconnect) or giving up must not cancel the download.
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.wait_s)
        except TimeoutError:
            logger.warning("adapter %s: not fetched within %g s; the download goes on", ref.id, self.wait_s)
            raise StoreUnreachable(f"the adapter's files did not arrive within {self.wait_s:g} s") from None

    def is_unreachable(self, ref_id: str) -> bool:
        """The last fetch of `ref_id` failed because the object store could not be reached."""
        with self._lock:
            return ref_id in self._unreachable

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _done(self, ref_id: str) -> None:
        with self._lock:
            self._fetching.pop(ref_id, None)

    def _forget(self, ref_id: str) -> None:
        with self._lock:
            self._unreachable.discard(ref_id)


def adapter_unavailable(model: str) -> APIError:
    """The retryable 503 for a request whose adapter's files cannot be fetched now."""
    return APIError(
        503,
        f"The adapter `{model}` cannot be loaded right now (its storage is unreachable); retry later.",
        code="adapter_unavailable",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )
