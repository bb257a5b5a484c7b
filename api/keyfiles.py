"""Secrets kept in the data directory (admin key, server secret, demo tenant key), mode 0600.

Written with O_CREAT|O_EXCL so two processes starting on one data dir agree on a single value, and
read back on every start so printed keys (and curl lines) keep working across restarts.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Callable
from pathlib import Path

ADMIN_KEY_FILE = "admin.key"
SERVER_SECRET_FILE = "server-secret"
DEMO_KEY_FILE = "demo-tenant.key"
ADMIN_KEY_SCHEME = "lsa"  # tenant keys are "lsk-...": the two can never be confused


def new_admin_key() -> str:
    return f"{ADMIN_KEY_SCHEME}-{secrets.token_urlsafe(32)}"


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
        return existing, False
    created = write_secret(path, make())
    value = read_secret(path)
    assert value is not None
    return value, created


def tenant_cache_salt(server_secret: str, tenant_id: str) -> bytes:
    """HMAC(server secret, tenant id): the per-tenant prefix-cache salt, never chosen by a caller."""
    return hmac.new(server_secret.encode(), tenant_id.encode(), hashlib.sha256).digest()
