"""Per-tenant import allowlists and source claims (tables in registry/import_models.py).

`set_import_prefixes` replaces a tenant's allowed prefixes (the caller has checked their form);
`claim_import_source` gives a source to the first tenant that imports from it and says whether the
caller owns it; `release_import_source` undoes a claim whose import failed. Each is one transaction.
"""

from __future__ import annotations

import enum
import hashlib

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError as SAIntegrityError
from sqlalchemy.orm import Session

from registry.db import transactional
from registry.errors import NotFound
from registry.import_models import ImportClaim, ImportGrant
from registry.models import Tenant


class Claim(enum.Enum):
    NEW = "new"  # claimed by this call
    HELD = "held"  # the caller's already
    TAKEN = "taken"  # another tenant's


def _sha256(uri: str) -> str:
    return hashlib.sha256(uri.encode()).hexdigest()


@transactional
def get_import_prefixes(session: Session, *, tenant_id: str) -> list[str]:
    """The prefixes `tenant_id` may import from, sorted (empty: none; NotFound for an unknown tenant)."""
    if session.get(Tenant, tenant_id) is None:
        raise NotFound("tenant", tenant_id)
    rows = session.scalars(select(ImportGrant.prefix).where(ImportGrant.tenant_id == tenant_id))
    return sorted(rows)


@transactional
def set_import_prefixes(session: Session, *, tenant_id: str, prefixes: list[str]) -> list[str]:
    """Replace the prefixes `tenant_id` may import from; returns them sorted, duplicates dropped."""
    if session.get(Tenant, tenant_id) is None:
        raise NotFound("tenant", tenant_id)
    session.execute(delete(ImportGrant).where(ImportGrant.tenant_id == tenant_id))
    unique = sorted(set(prefixes))
    session.add_all(ImportGrant(tenant_id=tenant_id, prefix_sha256=_sha256(p), prefix=p) for p in unique)
    return unique


@transactional
def claim_import_source(session: Session, *, tenant_id: str, source_uri: str) -> Claim:
    """Give `source_uri` to `tenant_id` unless another tenant has it (of concurrent claims, the unique
    key lets exactly one win)."""
    key = _sha256(source_uri)
    owner = session.scalar(select(ImportClaim.tenant_id).where(ImportClaim.source_sha256 == key))
    if owner is None:
        try:
            with session.begin_nested():
                session.add(ImportClaim(source_sha256=key, source_uri=source_uri, tenant_id=tenant_id))
            return Claim.NEW
        except SAIntegrityError:  # another claim committed in between
            owner = session.scalar(select(ImportClaim.tenant_id).where(ImportClaim.source_sha256 == key))
    return Claim.HELD if owner == tenant_id else Claim.TAKEN


@transactional
def is_claimed_by_another(session: Session, *, tenant_id: str, source_uri: str) -> bool:
    """Whether another tenant already imported from `source_uri` (a read: claims nothing)."""
    owner = session.scalar(
        select(ImportClaim.tenant_id).where(ImportClaim.source_sha256 == _sha256(source_uri))
    )
    return owner is not None and owner != tenant_id


@transactional
def release_import_source(session: Session, *, tenant_id: str, source_uri: str) -> None:
    """Drop `tenant_id`'s claim on `source_uri` (its import failed before anything was registered)."""
    session.execute(
        delete(ImportClaim).where(
            ImportClaim.source_sha256 == _sha256(source_uri), ImportClaim.tenant_id == tenant_id
        )
    )
