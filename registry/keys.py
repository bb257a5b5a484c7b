"""API keys: issue (shown once), revoke, list, authenticate.

Format `lsk-<prefix>-<secret>`: a 12-hex-digit public prefix (the key's id, safe to log and to put
in usage records) and 256 random bits. Only the prefix, a per-key salt and sha256(salt || key) are
stored; authentication compares digests in constant time (../shared/reference/platform.md, 6.6).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError as SAIntegrityError
from sqlalchemy.orm import Session

from registry.db import transactional
from registry.errors import AuthError, Conflict, NotFound
from registry.models import ApiKey, Tenant, TenantStatus, utcnow
from registry.types import KeyInfo, TenantInfo

KEY_SCHEME = "lsk"
_PREFIX_HEX = 12
_MAX_PREFIX_TRIES = 5
# Hashed when the prefix is unknown, so a miss costs the same time as a wrong secret.
_DUMMY_SALT = bytes(16)


def _digest(salt: bytes, api_key: str) -> str:
    return hashlib.sha256(salt + api_key.encode()).hexdigest()


def key_prefix(api_key: str) -> str:
    """The public prefix of a well-formed key; AuthError (without echoing the key) otherwise."""
    parts = api_key.split("-", 2)
    if len(parts) != 3 or parts[0] != KEY_SCHEME or len(parts[1]) != _PREFIX_HEX or not parts[2]:
        raise AuthError(f"malformed API key: expected '{KEY_SCHEME}-<{_PREFIX_HEX} hex>-<secret>'")
    return parts[1]


@transactional
def issue_key(session: Session, *, tenant_id: str, label: str | None = None) -> tuple[KeyInfo, str]:
    """Create a key for a live tenant; returns its info and the key itself (shown once)."""
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise NotFound("tenant", tenant_id)
    if tenant.status == TenantStatus.DELETED.value:
        raise Conflict(f"tenant {tenant.name!r} is deleted; no keys can be issued")
    for _ in range(_MAX_PREFIX_TRIES):
        prefix = secrets.token_hex(_PREFIX_HEX // 2)
        api_key = f"{KEY_SCHEME}-{prefix}-{secrets.token_urlsafe(32)}"
        salt = secrets.token_bytes(16)
        row = ApiKey(
            tenant_id=tenant_id, prefix=prefix, salt=salt.hex(), key_hash=_digest(salt, api_key), label=label
        )
        try:
            # A savepoint, so a prefix collision does not undo the caller's tenant row.
            with session.begin_nested():
                session.add(row)
        except SAIntegrityError:
            continue
        return KeyInfo.from_row(row), api_key
    raise Conflict(f"could not draw an unused key prefix in {_MAX_PREFIX_TRIES} tries")


@transactional
def revoke_key(session: Session, *, tenant_id: str, prefix: str) -> KeyInfo:
    """Revoke one of the tenant's keys (idempotent); another tenant's key is NotFound."""
    row = session.scalars(
        select(ApiKey).where(ApiKey.prefix == prefix, ApiKey.tenant_id == tenant_id)
    ).one_or_none()
    if row is None:
        raise NotFound("key", prefix)
    if row.revoked_at is None:
        row.revoked_at = utcnow()
    return KeyInfo.from_row(row)


@transactional
def list_keys(session: Session, *, tenant_id: str, include_revoked: bool = True) -> list[KeyInfo]:
    query = select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.id)
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    return [KeyInfo.from_row(row) for row in session.scalars(query)]


@transactional
def authenticate(session: Session, *, api_key: str) -> TenantInfo:
    """The active tenant owning `api_key`; AuthError for a malformed, unknown or revoked key or a
    suspended/deleted tenant. Use `key_prefix(api_key)` for the key's id in usage records."""
    key, tenant = _issued(session, api_key)
    prefix = key.prefix
    if key.revoked_at is not None or tenant.status == TenantStatus.DELETED.value:
        raise AuthError(f"API key {KEY_SCHEME}-{prefix}-... has been revoked")
    if tenant.status != TenantStatus.ACTIVE.value:
        raise AuthError(f"tenant {tenant.name!r} is {tenant.status}")
    return TenantInfo.from_row(tenant)


@transactional
def check_issued(session: Session, *, api_key: str) -> None:
    """AuthError (the message `authenticate` gives) unless this registry issued `api_key`, revoked or
    not, whatever its tenant's status: what tells a forged key from a real one. A key that fails it
    never passes it later (its secret was never drawn here), so the answer may be remembered."""
    _issued(session, api_key)


def _issued(session: Session, api_key: str) -> tuple[ApiKey, Tenant]:
    """The key's row and its tenant's, when the key is well formed and its digest matches."""
    prefix = key_prefix(api_key)
    found = session.execute(
        select(ApiKey, Tenant).join(Tenant, Tenant.id == ApiKey.tenant_id).where(ApiKey.prefix == prefix)
    ).one_or_none()
    if found is None:
        hmac.compare_digest(_digest(_DUMMY_SALT, api_key), "0" * 64)
        raise AuthError(f"invalid API key {KEY_SCHEME}-{prefix}-...")
    key, tenant = found.tuple()
    if not hmac.compare_digest(_digest(bytes.fromhex(key.salt), api_key), key.key_hash):
        raise AuthError(f"invalid API key {KEY_SCHEME}-{prefix}-...")
    return key, tenant
