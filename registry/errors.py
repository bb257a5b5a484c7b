"""Errors of the registry, one class per cause the API maps to a status code.

Messages carry the wrong value and what was expected; a "not found" never says whether the object
exists for somebody else (see ../shared/reference/platform.md, section 4.3: not-yours == unknown).
"""

from __future__ import annotations


class RegistryError(Exception):
    """Base class of every error raised by `registry`."""


class NotFound(RegistryError):
    """Unknown name, or a name owned by another tenant: the two are indistinguishable on purpose."""

    def __init__(self, kind: str, name: str) -> None:
        super().__init__(f"{kind} {name!r} not found")
        self.kind = kind
        self.name = name


class Conflict(RegistryError):
    """A unique name is already taken (tenant names), or a write lost a race it cannot retry."""


class InvalidName(RegistryError):
    """A tenant or adapter name outside the allowed pattern (path separators, '@', too long...)."""


class InvalidAdapter(RegistryError):
    """The uploaded files are not an adapter this deployment can serve (bad name, format, shapes)."""


class IntegrityError(RegistryError):
    """Stored data does not match what the metadata promises."""


class HashMismatch(IntegrityError):
    """A downloaded object's sha256 differs from its content address."""

    def __init__(self, key: str, expected: str, actual: str) -> None:
        super().__init__(f"object {key!r} has sha256 {actual}, expected {expected}; refusing to use it")
        self.key = key
        self.expected = expected
        self.actual = actual


class ObjectNotFound(RegistryError):
    """The object store has no object under the key (e.g. deleted behind the registry's back)."""

    def __init__(self, store_url: str, key: str) -> None:
        super().__init__(f"object {key!r} not found in store {store_url}")
        self.store_url = store_url
        self.key = key


class StoreUnavailable(RegistryError):
    """The object store cannot be used: endpoint unreachable, bucket missing, access denied."""


class AuthError(RegistryError):
    """Bad, revoked or malformed API key, or a key whose tenant is suspended or deleted."""


class QuotaExceeded(RegistryError):
    """A per-tenant limit (adapters stored, adapter bytes) would be exceeded."""

    def __init__(self, limit: str, value: int, maximum: int) -> None:
        super().__init__(f"quota {limit} exceeded: {value} > {maximum}")
        self.limit = limit
        self.value = value
        self.maximum = maximum
