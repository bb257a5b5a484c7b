"""The API's adapter fetch in front of a hung object store (moto behind tests/harness/hanging_proxy.py):
an adapter already on local disk is answered at once, never queued behind downloads that hang, and a
cold adapter's wait is bounded by `wait_s`, queue included, whatever the store's own timeouts."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from adapters.types import AdapterRef
from api.inference.adapter_fetch import AdapterFetch, StoreUnreachable
from api.settings import Settings
from registry.disk_cache import DiskTier
from registry.s3 import S3Store
from registry.store import ObjectStore, put_content
from registry.types import CONFIG_FILE, WEIGHTS_FILE, make_source
from tests.harness.hanging_proxy import HangingProxy

_WAIT_S = 1.5
Outcome = tuple[BaseException | None, float]  # what a call ended with, and after how long


def _stored_adapter(store: ObjectStore, tmp: Path, i: int) -> AdapterRef:
    """Two objects in `store` as a registry adapter's files (the disk tier checks hashes, not format)."""
    d = tmp / f"src-{i}"
    d.mkdir()
    (d / CONFIG_FILE).write_text(f'{{"r": {i}}}')
    (d / WEIGHTS_FILE).write_bytes(os.urandom(2048))
    config, weights = put_content(store, d / CONFIG_FILE), put_content(store, d / WEIGHTS_FILE)
    return AdapterRef(id=f"t/a{i}@1", sha256=weights, source=make_source(config, weights), name=f"a{i}")


async def _timed(fetch: AdapterFetch, ref: AdapterRef) -> Outcome:
    start = time.monotonic()
    try:
        await fetch.ensure_local(ref)
    except BaseException as exc:  # noqa: BLE001 - what each call ended with is the result
        return exc, time.monotonic() - start
    return None, time.monotonic() - start


async def _local_behind_hung_downloads(
    fetch: AdapterFetch, local: AdapterRef, cold: list[AdapterRef]
) -> tuple[list[Outcome], Outcome]:
    downloads = [asyncio.create_task(_timed(fetch, ref)) for ref in cold]  # fill the pool, and one more
    await asyncio.sleep(0.3)
    local_result = await asyncio.wait_for(_timed(fetch, local), 5)
    return await asyncio.wait_for(asyncio.gather(*downloads), 10), local_result


@pytest.mark.slow
def test_local_adapter_never_waits_behind_a_hung_store_and_cold_ones_fail_within_the_bound(
    s3_bucket: str, s3_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with HangingProxy(s3_server) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        # A read timeout well past the wait bound: the bound, not the store, ends the wait.
        store = S3Store(bucket=s3_bucket, prefix="r", max_attempts=1, connect_timeout_s=1, read_timeout_s=4)
        refs = [_stored_adapter(store, tmp_path, i) for i in range(6)]
        fetch = AdapterFetch(DiskTier(tmp_path / "disk", store), wait_s=_WAIT_S)
        try:
            asyncio.run(fetch.ensure_local(refs[0]))  # on local disk from now on
            proxy.hang()
            cold, (local_error, local_s) = asyncio.run(_local_behind_hung_downloads(fetch, refs[0], refs[1:]))
        finally:
            proxy.resume()
            fetch.shutdown()
    assert local_error is None and local_s < 0.3, (local_error, local_s)
    for error, seconds in cold:  # four downloads hang in the pool; the fifth waits for a thread
        assert isinstance(error, StoreUnreachable), error
        assert seconds < _WAIT_S + 0.7, seconds


def test_shipped_defaults_bound_a_cold_fetch_within_ten_seconds() -> None:
    assert Settings().adapter_fetch_wait_s <= 10
