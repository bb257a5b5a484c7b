"""Content-addressed object store: one small protocol and a local-directory backend.

Objects live under the sha256 of their bytes (`sha256/<hex>`), so a put is idempotent and a
download is checked against its own key before use (../shared/reference/platform.md, section 4.2:
"store the sha256 digest, and dedupe on it"). `LocalStore` is the embedded default; the S3 backend
is `registry.s3.S3Store`, and `registry.stores.open_store(url)` picks one from a URL.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

from registry.errors import HashMismatch, ObjectNotFound, StoreUnavailable

_CHUNK = 1 << 20
CONTENT_PREFIX = "sha256/"


@runtime_checkable
class ObjectStore(Protocol):
    """What the registry needs from a blob store. Keys are relative, '/'-separated, never '..'."""

    url: str

    def check(self) -> None:
        """Raise StoreUnavailable unless objects can be listed and written."""
        ...

    def put(self, key: str, src: Path) -> None:
        """Upload the file `src` under `key` (replacing any object there)."""
        ...

    def get(self, key: str, dest: Path) -> None:
        """Download `key` to the file `dest`; ObjectNotFound when missing."""
        ...

    def exists(self, key: str) -> bool: ...

    def size(self, key: str) -> int:
        """Bytes in the object `key`, without downloading it; ObjectNotFound when missing."""
        ...

    def delete(self, key: str) -> None:
        """Remove `key`; deleting a missing key is not an error."""
        ...

    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys starting with `prefix`, in no promised order."""
        ...


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def content_key(sha256: str) -> str:
    """The store key of the object whose bytes hash to `sha256`."""
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise ValueError(f"sha256 must be 64 lowercase hex digits, got {sha256!r}")
    return CONTENT_PREFIX + sha256


def put_content(store: ObjectStore, src: Path) -> str:
    """Store `src` under its own hash and return the hash; skips the upload when already present."""
    sha256 = sha256_file(src)
    key = content_key(sha256)
    if not store.exists(key):
        store.put(key, src)
    return sha256


def get_verified(store: ObjectStore, sha256: str, dest: Path) -> None:
    """Download the object `sha256` to `dest`, visible only once its hash has been checked.

    The bytes land in a temporary sibling of `dest` first; on any failure (interrupted transfer,
    HashMismatch) the temporary file is removed and `dest` never appears.
    """
    key = content_key(sha256)
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.part")
    try:
        store.get(key, tmp)
        actual = sha256_file(tmp)
        if actual != sha256:
            raise HashMismatch(key, sha256, actual)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"object key must be a relative path without '.', '..' or empty parts, got {key!r}")
    return key


class LocalStore:
    """Objects as files under a root directory; writes go through a temp file and a rename."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.url = self.root.resolve().as_uri()

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def check(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreUnavailable(f"cannot create store directory {self.root}: {e}") from e
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StoreUnavailable(f"store directory {self.root} is not writable")

    def put(self, key: str, src: Path) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.part")
        try:
            shutil.copyfile(src, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def get(self, key: str, dest: Path) -> None:
        path = self._path(key)
        try:
            shutil.copyfile(path, dest)
        except FileNotFoundError as e:
            raise ObjectNotFound(self.url, key) from e

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        path = self._path(key)
        if not path.is_file():  # missing, or a directory, FIFO or device: never an object
            raise ObjectNotFound(self.url, key)
        return path.stat().st_size

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def list(self, prefix: str = "") -> Iterator[str]:
        if not self.root.is_dir():
            return
        for path in sorted(self.root.rglob("*")):
            key = path.relative_to(self.root).as_posix()
            # Skip in-flight temp files: they are not objects yet.
            if path.is_file() and not path.name.startswith(".") and key.startswith(prefix):
                yield key
