"""Secrets kept in the data directory (admin key, server secret, demo tenant key), mode 0600, and
the modes of the data directory itself.

Written with O_CREAT|O_EXCL so two processes starting on one data dir agree on a single value, and
read back on every start so printed keys (and curl lines) keep working across restarts. The data
directory is 0700 and the SQLite database (with its WAL and shared-memory files) 0600, tightened on
every start; `loraserve serve` also runs with umask 077, so whatever else it creates (journal,
objects, disk tier, uploads) is private to the server's user too.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from sqlalchemy.engine import make_url

ADMIN_KEY_FILE = "admin.key"
SERVER_SECRET_FILE = "server-secret"
DEMO_KEY_FILE = "demo-tenant.key"
ADMIN_KEY_SCHEME = "lsa"  # tenant keys are "lsk-...": the two can never be confused


def new_admin_key() -> str:
    return f"{ADMIN_KEY_SCHEME}-{secrets.token_urlsafe(32)}"


def make_private_dir(path: Path) -> Path:
    """`path` as a directory only its owner can enter (0700), created with its parents if missing."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def make_private_database(db_url: str) -> None:
    """A SQLite database file (and its WAL/SHM files, which SQLite creates with the database's mode)
    exists as 0600 before anything opens it; other databases keep their server's own protection."""
    url = make_url(db_url)
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return
    database = Path(url.database)
    database.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(database, os.O_WRONLY | os.O_CREAT, 0o600))
    for path in (database, Path(f"{database}-wal"), Path(f"{database}-shm"), Path(f"{database}-journal")):
        if path.exists():
            path.chmod(0o600)


def read_secret(path: Path) -> str | None:
    try:
        value = path.read_text().strip()
    except FileNotFoundError:
        return None
    if not value:
        raise ValueError(f"secret file {path} is empty; delete it to have a new secret generated")
    return value


def write_secret(path: Path, value: str) -> bool:
    """Write `value` to a new 0600 file; False (nothing written) when the file already exists."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return True


def replace_secret(path: Path, value: str) -> None:
    """Write `value` to `path` (0600) atomically, replacing any previous value."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    write_secret(tmp, value)
    os.replace(tmp, path)


def read_or_create_secret(path: Path, make: Callable[[], str]) -> tuple[str, bool]:
    """(secret, created): the value in `path`, or a new `make()` stored there first."""
    existing = read_secret(path)
    if existing is not None:
        path.chmod(0o600)  # a file another tool (or an older version) left readable
        return existing, False
    created = write_secret(path, make())
    value = read_secret(path)
    assert value is not None
    return value, created


def tenant_cache_salt(server_secret: str, tenant_id: str) -> bytes:
    """HMAC(server secret, tenant id): the per-tenant prefix-cache salt, never chosen by a caller."""
    return hmac.new(server_secret.encode(), tenant_id.encode(), hashlib.sha256).digest()
