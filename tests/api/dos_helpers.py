"""Helpers of the denial-of-service tests (test_denial_of_service*.py): bearer headers, a timed call,
and a poller that measures a URL's latency on a thread while an attack runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx


def timed(fn: Callable[[], httpx.Response]) -> tuple[float, httpx.Response]:
    start = time.monotonic()
    response = fn()
    return time.monotonic() - start, response


class Poller:
    """GETs `url` in a loop on a thread; records each latency (a timeout counts as its full length)."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.url, self.timeout_s = url, timeout_s
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                try:
                    self.statuses.append(client.get(self.url).status_code)
                except httpx.HTTPError:
                    self.statuses.append(0)
                self.latencies.append(time.monotonic() - start)
                time.sleep(0.02)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + 5)
