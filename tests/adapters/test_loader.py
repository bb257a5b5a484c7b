"""Adapter loads: transient failures expire with backoff, format errors stay refused, a local-disk hit
never waits behind a hung remote fetch, and a fetch has a deadline."""

from __future__ import annotations

import threading
import time
from functools import partial
from pathlib import Path

import pytest

from adapters import loader as loader_module
from adapters.format import load_adapter
from adapters.loader import AdapterLoader, backoff_s
from adapters.testing import save_random_adapter
from adapters.types import AdapterRef
from tests.harness.peft_adapters import tiny_shapes
from tests.harness.wait import wait_for


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_adapter(tmp_path_factory.mktemp("loader") / "a", tiny_shapes(), rank=4, seed=1)


def _ref(name: str, path: Path) -> AdapterRef:
    return AdapterRef(id=f"t/{name}@1", sha256="0" * 64, source=str(path), name=name)


def _parse():
    return partial(load_adapter, base=tiny_shapes(), max_lora_rank=16)


def _poll_until(loader: AdapterLoader, ref: AdapterRef, timeout: float = 10.0) -> str:
    """Poll the loader until `ref` is "loaded" or "failed"."""

    def outcome() -> str | None:
        done, failures = loader.poll()
        if any(r == ref.id for r, _, _ in done):
            return "loaded"
        if any(r == ref.id for r, _ in failures):
            return "failed"
        return None

    return wait_for(outcome, timeout, interval=0.01, what=f"{ref.id} loaded or failed")


def test_backoff_starts_within_5_s_and_is_capped_at_60_s() -> None:
    assert [backoff_s(n) for n in range(1, 8)] == [2, 4, 8, 16, 32, 60, 60]


def test_transient_fetch_error_expires(adapter_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(loader_module, "RETRY_UNREACHABLE_S", 0.05)
    calls = {"n": 0}

    def flaky_fetch(ref: AdapterRef) -> Path:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ConnectionError("S3 blip")
        return adapter_dir

    loader = AdapterLoader(flaky_fetch, _parse())
    ref = _ref("a", adapter_dir)
    loader.start(ref)
    assert _poll_until(loader, ref) == "failed"
    assert "S3 blip" in loader.error(ref) and 0 < loader.retry_after_s(ref) <= 0.05
    loader.start(ref)  # during the pause: refused without a new fetch
    assert calls["n"] == 1
    time.sleep(0.06)
    assert loader.error(ref) is None  # the pause is over
    loader.start(ref)
    assert _poll_until(loader, ref) == "loaded" and calls["n"] == 2
    assert ref.id not in loader.failed and ref.id not in loader.num_failures


def test_format_error_stays_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(loader_module, "RETRY_UNREACHABLE_S", 0.01)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text('{"peft_type": "PREFIX_TUNING"}')
    loader = AdapterLoader(lambda ref: broken, _parse())
    ref = _ref("broken", broken)
    loader.start(ref)
    assert _poll_until(loader, ref) == "failed"
    time.sleep(0.05)
    assert "adapter_model.safetensors is missing" in (loader.error(ref) or "")
    assert loader.retry_after_s(ref) is None
    loader.start(ref)
    assert ref.id not in loader.pending


class _SlowRemote:
    """Remote fetches hang until released; adapters already on disk are reported by local_path."""

    def __init__(self, on_disk: dict[str, Path], remote_dir: Path) -> None:
        self.on_disk = on_disk
        self.remote_dir = remote_dir
        self.release = threading.Event()

    def __call__(self, ref: AdapterRef) -> Path:
        self.release.wait(30)
        return self.remote_dir

    def local_path(self, ref: AdapterRef) -> Path | None:
        return self.on_disk.get(ref.id)


def test_disk_hit_never_waits_behind_hung_remote_fetches(adapter_dir: Path) -> None:
    local = _ref("local", adapter_dir)
    fetch = _SlowRemote({local.id: adapter_dir}, adapter_dir)
    loader = AdapterLoader(fetch, _parse(), num_fetch_workers=2)
    try:
        remotes = [_ref(f"remote{i}", adapter_dir) for i in range(5)]  # more than the fetch pool
        for ref in remotes:
            loader.start(ref)
        loader.start(local)
        assert _poll_until(loader, local, timeout=10) == "loaded"
        assert all(r.id in loader.pending for r in remotes)
    finally:
        fetch.release.set()


def test_hung_fetch_fails_at_its_deadline_and_is_retried_later(adapter_dir: Path) -> None:
    fetch = _SlowRemote({}, adapter_dir)
    loader = AdapterLoader(fetch, _parse(), deadline_s=0.2)
    ref = _ref("hung", adapter_dir)
    try:
        loader.start(ref)
        assert _poll_until(loader, ref) == "failed"
        assert "did not finish within 0.2 s" in loader.error(ref)
        assert loader.retry_after_s(ref) is not None  # transient: tried again after the pause
    finally:
        fetch.release.set()
