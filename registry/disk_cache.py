"""The disk tier: adapters fetched from the object store into a bounded local directory.

`DiskTier.fetch(ref) -> Path` is the `fetch` callable handed to the adapter cache (ARCHITECTURE.md:
`adapters` never imports `registry`). Each adapter version becomes `<root>/<weights>-<config>/`
holding the two PEFT files. Downloads go to `<root>/.tmp-*`, are verified against their sha256
and only then renamed into place, so a half-downloaded or corrupt adapter is never visible.
Eviction is least-recently-used by bytes; recency is each directory's mtime, so the index is
rebuilt from disk after a restart.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import uuid
from collections import OrderedDict
from pathlib import Path

from adapters.types import AdapterRef
from registry.errors import IntegrityError
from registry.store import ObjectStore, get_verified
from registry.types import CONFIG_FILE, WEIGHTS_FILE, parse_source

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 4 << 30
_TMP_PREFIX = ".tmp-"


def _entry_name(config_sha256: str, weights_sha256: str) -> str:
    return f"{weights_sha256}-{config_sha256}"


def _is_entry_name(name: str) -> bool:
    weights, _, config = name.partition("-")
    try:
        parse_source(f"{config}:{weights}")
    except ValueError:
        return False
    return True


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


class DiskTier:
    """Bounded, restart-surviving, verified local copies of adapter versions. Thread-safe.

    An entry larger than `max_bytes` is still kept (alone): the caller asked for it. Size the tier
    to hold many adapters: a directory returned by `fetch` can be evicted by later fetches, so the
    caller should read it soon (the adapter cache loads it right away).
    """

    def __init__(self, root: Path, store: ObjectStore, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.root = Path(root)
        self.store = store
        self.max_bytes = max_bytes
        self._lock = threading.Lock()  # guards _entries
        self._fetch_locks: dict[str, threading.Lock] = {}  # one download per entry at a time
        self._entries: OrderedDict[str, int] = OrderedDict()  # entry name -> bytes, oldest first
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.root.chmod(0o700)  # tenants' adapters: readable by the server's user only
        self._load_index()

    def _load_index(self) -> None:
        found: list[tuple[float, str, int]] = []
        for path in self.root.iterdir():
            if path.name.startswith(_TMP_PREFIX):
                # Left by an interrupted download or eviction: never a valid entry.
                shutil.rmtree(path, ignore_errors=True)
            elif path.is_dir() and _is_entry_name(path.name):
                if (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file():
                    found.append((path.stat().st_mtime, path.name, _dir_bytes(path)))
                else:
                    shutil.rmtree(path, ignore_errors=True)
        for _, name, num_bytes in sorted(found):
            self._entries[name] = num_bytes
        with self._lock:
            self._evict(keep=None)
        logger.info("disk tier %s: %d adapters, %d bytes", self.root, len(self._entries), self.num_bytes)

    @property
    def num_bytes(self) -> int:
        return sum(self._entries.values())

    def entries(self) -> list[str]:
        """Entry directory names, least recently used first."""
        with self._lock:
            return list(self._entries)

    def __call__(self, ref: AdapterRef) -> Path:
        return self.fetch(ref)

    def local_path(self, ref: AdapterRef) -> Path | None:
        """The adapter's directory when it is already on this disk (no download), else None."""
        try:
            config_sha256, weights_sha256 = parse_source(ref.source)
        except ValueError:
            return None  # `fetch` names what is wrong with the source
        if ref.sha256 != weights_sha256:
            return None
        name = _entry_name(config_sha256, weights_sha256)
        path = self.root / name
        with self._lock:
            if name in self._entries and path.is_dir():
                self._entries.move_to_end(name)
                return path
        return None

    def fetch(self, ref: AdapterRef) -> Path:
        """A local directory with the adapter's two files, downloading and verifying on a miss.

        Raises ValueError for a malformed `ref.source`, IntegrityError when `ref.sha256` is not the
        weights hash in `ref.source` or a download fails verification (HashMismatch), and the
        store's errors (StoreUnavailable, ObjectNotFound) when it cannot be read.
        """
        config_sha256, weights_sha256 = parse_source(ref.source)
        if ref.sha256 != weights_sha256:
            raise IntegrityError(
                f"adapter {ref.id!r}: sha256 {ref.sha256} does not match source {ref.source}"
            )
        name = _entry_name(config_sha256, weights_sha256)
        path = self.root / name
        with self._lock:
            fetch_lock = self._fetch_locks.setdefault(name, threading.Lock())
        with fetch_lock:
            with self._lock:
                if name in self._entries and path.is_dir():
                    self._entries.move_to_end(name)
                    os.utime(path)  # recency survives restarts
                    return path
                self._entries.pop(name, None)  # removed behind our back: download again
            num_bytes = self._download(config_sha256, weights_sha256, path)
            with self._lock:
                self._entries[name] = num_bytes
                self._evict(keep=name)
        logger.info("disk tier: fetched %s (%d bytes) from %s", ref.id, num_bytes, self.store.url)
        return path

    def _download(self, config_sha256: str, weights_sha256: str, path: Path) -> int:
        tmp = self.root / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        tmp.mkdir(mode=0o700)
        try:
            get_verified(self.store, config_sha256, tmp / CONFIG_FILE)
            get_verified(self.store, weights_sha256, tmp / WEIGHTS_FILE)
            for name in (CONFIG_FILE, WEIGHTS_FILE):
                (tmp / name).chmod(0o600)
            num_bytes = _dir_bytes(tmp)
            if path.exists():
                # Another process sharing the root won the race; its copy was verified too.
                shutil.rmtree(tmp)
            else:
                os.rename(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return num_bytes

    def _evict(self, *, keep: str | None) -> None:
        # Caller holds self._lock.
        while self.num_bytes > self.max_bytes and len(self._entries) > (1 if keep else 0):
            name = next(iter(self._entries))
            if name == keep:
                self._entries.move_to_end(name)
                continue
            num_bytes = self._entries.pop(name)
            # Rename first so the directory disappears atomically, then delete at leisure.
            doomed = self.root / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
            try:
                os.rename(self.root / name, doomed)
            except FileNotFoundError:
                continue
            shutil.rmtree(doomed, ignore_errors=True)
            logger.info("disk tier: evicted %s (%d bytes)", name, num_bytes)
