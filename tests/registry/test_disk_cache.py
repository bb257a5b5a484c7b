"""The disk tier: verified, atomic, LRU by bytes, restart-surviving; LocalStore and S3 behind it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from adapters.types import AdapterRef
from registry.disk_cache import DiskTier
from registry.errors import HashMismatch, IntegrityError, ObjectNotFound, StoreUnavailable
from registry.store import LocalStore, ObjectStore, content_key, put_content
from registry.types import CONFIG_FILE, WEIGHTS_FILE, make_source
from tests.harness.raw_adapters import write_adapter


def _upload(store: ObjectStore, directory: Path, ref_id: str = "t/bot@1") -> AdapterRef:
    config_sha = put_content(store, directory / CONFIG_FILE)
    weights_sha = put_content(store, directory / WEIGHTS_FILE)
    return AdapterRef(id=ref_id, sha256=weights_sha, source=make_source(config_sha, weights_sha), name="bot")


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir())


def _visible(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_fetch_downloads_verified_files_then_hits(store: ObjectStore, tmp_path: Path) -> None:
    src = write_adapter(tmp_path / "src")
    ref = _upload(store, src)
    tier = DiskTier(tmp_path / "tier", store, max_bytes=1 << 20)
    path = tier.fetch(ref)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        assert (path / name).read_bytes() == (src / name).read_bytes()
    assert _visible(tmp_path / "tier") == [path.name]  # no temp leftovers
    for key in list(store.list()):
        store.delete(key)
    assert tier(ref) == path  # a hit never goes to the store (it is empty now)
    assert tier.num_bytes == _size(path)


def test_corrupt_object_is_never_served(store: ObjectStore, tmp_path: Path) -> None:
    ref = _upload(store, write_adapter(tmp_path / "src"))
    evil = write_adapter(tmp_path / "evil", seed=9) / WEIGHTS_FILE
    store.put(content_key(ref.sha256), evil)  # the store now holds other bytes under the weights' hash
    tier = DiskTier(tmp_path / "tier", store)
    with pytest.raises(HashMismatch, match=f"expected {ref.sha256}"):
        tier.fetch(ref)
    assert _visible(tmp_path / "tier") == []
    assert tier.entries() == []


def test_ref_must_agree_with_its_source(store: ObjectStore, tmp_path: Path) -> None:
    ref = _upload(store, write_adapter(tmp_path / "src"))
    tier = DiskTier(tmp_path / "tier", store)
    with pytest.raises(IntegrityError, match="does not match source"):
        tier.fetch(AdapterRef(id=ref.id, sha256="0" * 64, source=ref.source))
    with pytest.raises(ValueError, match="adapter source"):
        tier.fetch(AdapterRef(id=ref.id, sha256=ref.sha256, source="/some/dir"))
    missing = AdapterRef(id="x", sha256="1" * 64, source=make_source("2" * 64, "1" * 64))
    with pytest.raises(ObjectNotFound):
        tier.fetch(missing)
    assert _visible(tmp_path / "tier") == []


class _DroppingStore(LocalStore):
    """A store whose connection drops halfway through the weights download."""

    def get(self, key: str, dest: Path) -> None:
        data = (self.root / key).read_bytes()
        if len(data) < 1000:  # the config downloads fine
            dest.write_bytes(data)
            return
        with open(dest, "wb") as f:
            f.write(data[: len(data) // 2])
        raise StoreUnavailable(f"connection reset while reading {key}")


def test_interrupted_download_is_never_visible(tmp_path: Path) -> None:
    good = LocalStore(tmp_path / "objects")
    ref = _upload(good, write_adapter(tmp_path / "src"))
    root = tmp_path / "tier"
    with pytest.raises(StoreUnavailable, match="connection reset"):
        DiskTier(root, _DroppingStore(tmp_path / "objects")).fetch(ref)
    assert _visible(root) == []
    # A crash mid-download leaves a temp dir behind; the next start removes it.
    (root / ".tmp-crashed").mkdir()
    (root / ".tmp-crashed" / WEIGHTS_FILE).write_bytes(b"half")
    tier = DiskTier(root, good)
    assert _visible(root) == []
    path = tier.fetch(ref)
    assert hashlib.sha256((path / WEIGHTS_FILE).read_bytes()).hexdigest() == ref.sha256


def test_lru_by_bytes_survives_restart(store: ObjectStore, tmp_path: Path) -> None:
    refs = [_upload(store, write_adapter(tmp_path / f"a{i}", seed=i), f"t/a{i}@1") for i in range(4)]
    root = tmp_path / "tier"
    one = _size(DiskTier(tmp_path / "probe", store).fetch(refs[0]))  # all four have the same size
    tier = DiskTier(root, store, max_bytes=3 * one)
    paths = [tier.fetch(r) for r in refs[:3]]
    for i, path in enumerate(paths):  # distinct, ordered mtimes whatever the clock resolution
        os.utime(path, (1_000_000 + i, 1_000_000 + i))
    tier = DiskTier(root, store, max_bytes=3 * one)  # restart: index rebuilt from disk
    assert tier.entries() == [p.name for p in paths]
    assert tier.num_bytes == 3 * one
    tier.fetch(refs[0])  # a0 becomes most recent, so a1 is the oldest
    newest = tier.fetch(refs[3])
    assert tier.num_bytes <= 3 * one
    assert set(_visible(root)) == {paths[0].name, paths[2].name, newest.name}
    os.utime(paths[0], (2_000_000, 2_000_000))
    os.utime(newest, (2_000_001, 2_000_001))
    smaller = DiskTier(root, store, max_bytes=one)  # restart with a smaller budget evicts at once
    assert smaller.entries() == [newest.name] and _visible(root) == [newest.name]
    assert smaller.num_bytes == one


def test_entry_larger_than_budget_is_still_served(store: ObjectStore, tmp_path: Path) -> None:
    ref = _upload(store, write_adapter(tmp_path / "src"))
    tier = DiskTier(tmp_path / "tier", store, max_bytes=10)
    path = tier.fetch(ref)
    assert (path / WEIGHTS_FILE).is_file() and tier.entries() == [path.name]
    with pytest.raises(ValueError, match="max_bytes"):
        DiskTier(tmp_path / "x", store, max_bytes=0)
