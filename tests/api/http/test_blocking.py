"""api.http.blocking: /ready probes are single-flight and bounded in time; the upload gate never waits."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from api.http.blocking import Probe, UploadGate


def test_hung_probe_pins_one_thread_and_answers_within_its_timeout() -> None:
    release, calls = threading.Event(), []

    def hangs() -> None:
        calls.append(1)
        release.wait(10)

    pool = ThreadPoolExecutor(2)
    probe = Probe("store", hangs, pool)

    async def scrape() -> list[object]:
        return [await probe.run(0.1) for _ in range(5)]

    try:
        results = asyncio.run(scrape())
        assert [r.ok for r in results] == [False] * 5  # type: ignore[attr-defined]
        assert all("no answer" in r.detail for r in results)  # type: ignore[attr-defined]
        assert len(calls) == 1  # five scrapes, one check in flight
        release.set()
        assert asyncio.run(probe.run(5)).ok
    finally:
        release.set()
        pool.shutdown()


def test_failing_probe_reports_only_the_exception_type() -> None:
    def fails() -> None:
        raise ConnectionError("http://internal-endpoint:9000 refused")

    with ThreadPoolExecutor(1) as pool:
        result = asyncio.run(Probe("db", fails, pool).run(5))
    assert not result.ok and result.detail == "ConnectionError"


def test_upload_gate() -> None:
    gate = UploadGate(2)
    assert gate.try_enter() and gate.try_enter() and not gate.try_enter()
    gate.leave()
    assert gate.try_enter()
    gate.leave()
    gate.leave()
    with pytest.raises(RuntimeError):
        gate.leave()
