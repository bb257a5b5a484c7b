"""Blocking work that may hang on a dependency runs in bounded thread pools of its own.

FastAPI runs sync routes and sync dependencies in anyio's default thread pool (40 threads), shared
by inference (authentication, planning), `/metrics`, the admin API and the console. Measured before
these pools: uploads stuck on a hung S3 held all 40, and `/health`, `/ready`, `/metrics` and
base-model chat each waited 56.7 s. Now:

- `UploadGate`: at most `max_concurrent_uploads` uploads are received, validated, stored and recorded
  at once; one more is refused at once with 429 + Retry-After. An admitted upload's blocking part
  (validation, object store, database) runs in `BlockingPools.uploads`, a pool of that same size, so
  a hung store pins at most those threads and nothing else ever queues behind them.
- `Probe`: a dependency check for `/ready`, single-flight (a probe still running is not started
  again, so a hung dependency pins one `BlockingPools.probes` thread, not one per scrape) and waited
  for at most `timeout_s`.
- `BlockingPools.ops`: small CPU-bound work of the operational endpoints (`/metrics` rendering),
  off the event loop and away from the default pool.
- `BlockingPools.keys`: the key precheck's lookups of keys it has not seen (api/tenancy/key_precheck.py);
  its size bounds the queries forged keys can have in flight.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)

_PROBE_THREADS = 4  # one per dependency (database, object store) and spares
_OPS_THREADS = 2
_KEY_THREADS = 2  # database lookups of keys not yet seen (api/tenancy/key_precheck.py)


class UploadGate:
    """A counting gate without waiting: `try_enter` says at once whether there is room."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self.active = 0
        self._lock = threading.Lock()

    def try_enter(self) -> bool:
        with self._lock:
            if self.active >= self.limit:
                return False
            self.active += 1
            return True

    def leave(self) -> None:
        with self._lock:
            if self.active <= 0:
                raise RuntimeError("UploadGate.leave without a matching try_enter")
            self.active -= 1


class BlockingPools:
    """The server's own thread pools (see the module docstring); `shutdown` ends them."""

    def __init__(self, *, max_uploads: int) -> None:
        self.uploads = ThreadPoolExecutor(max_workers=max_uploads, thread_name_prefix="upload")
        self.probes = ThreadPoolExecutor(max_workers=_PROBE_THREADS, thread_name_prefix="probe")
        self.ops = ThreadPoolExecutor(max_workers=_OPS_THREADS, thread_name_prefix="ops")
        self.keys = ThreadPoolExecutor(max_workers=_KEY_THREADS, thread_name_prefix="keys")

    def shutdown(self) -> None:
        for pool in (self.uploads, self.probes, self.ops, self.keys):
            pool.shutdown(wait=False, cancel_futures=True)


async def run_in(pool: ThreadPoolExecutor, fn: Callable[[], T]) -> T:
    """`fn()` in `pool`, awaited from the event loop."""
    return await asyncio.wrap_future(pool.submit(fn))


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool
    detail: str  # "ok", or what failed: an exception's type (the message is logged), or the timeout
    seconds: float  # how long the probe took (or has been running, when it timed out)


class Probe:
    """A named, single-flight dependency check run in a pool and awaited with a timeout."""

    def __init__(self, name: str, check: Callable[[], None], pool: ThreadPoolExecutor) -> None:
        self.name = name
        self._check = check
        self._pool = pool
        self._lock = threading.Lock()
        self._running: Future[float] | None = None
        self._started = 0.0

    def _start(self) -> tuple[Future[float], float]:
        with self._lock:
            if self._running is None or self._running.done():
                self._started = time.monotonic()
                self._running = self._pool.submit(self._timed)
            return self._running, self._started

    def _timed(self) -> float:
        start = time.monotonic()
        self._check()
        return time.monotonic() - start

    async def run(self, timeout_s: float) -> ProbeResult:
        future, started = self._start()
        try:
            seconds = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout_s)
        except TimeoutError:
            waited = time.monotonic() - started
            return ProbeResult(False, f"no answer after {waited:.1f} s", waited)
        except Exception as exc:  # noqa: BLE001 - any failure of the dependency means "not ok"
            logger.warning("readiness probe %s failed: %s", self.name, exc)
            return ProbeResult(False, type(exc).__name__, time.monotonic() - started)
        return ProbeResult(True, "ok", seconds)
