"""Adapter versions in the registry: register (validate -> store -> row), resolve, list, delete.

An upload is a PEFT LoRA directory (`adapter_config.json` + `adapter_model.safetensors`, the PEFT
file names). Versions are immutable and numbered 1, 2, 3... per (tenant, name); names are unique
per tenant, never globally. Registration puts both files into the content-addressed store first
(idempotent), then inserts the row in its own transaction: a failure before the row leaves at most
unreferenced objects, never a row without objects. Two concurrent registrations of one name race
on the UNIQUE(tenant_id, name, version) constraint; the loser retries with the next number.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError as SAIntegrityError
from sqlalchemy.orm import Session

from adapters.types import AdapterSummary
from registry.db import transactional
from registry.errors import Conflict, IntegrityError, InvalidAdapter, NotFound, QuotaExceeded
from registry.models import AdapterStatus, AdapterVersion, Tenant, TenantStatus, utcnow
from registry.store import ObjectStore, put_content
from registry.tenants import check_name
from registry.types import CONFIG_FILE, WEIGHTS_FILE, AdapterVersionInfo

logger = logging.getLogger(__name__)

_MAX_VERSION_TRIES = 10
MAX_VERSION = 2**31 - 1  # the column is an INTEGER: larger numbers name no version (and would not bind)


class Registration(NamedTuple):
    info: AdapterVersionInfo
    is_new: bool  # False: the name's latest ready version already holds these exact files


def register_adapter_version(
    session: Session,
    store: ObjectStore,
    *,
    tenant_id: str,
    name: str,
    files_dir: Path,
    validate: Callable[[Path], AdapterSummary],
    base_model: str,
) -> AdapterVersionInfo:
    """`register_adapter`'s version (new, or the identical latest one)."""
    return register_adapter(
        session,
        store,
        tenant_id=tenant_id,
        name=name,
        files_dir=files_dir,
        validate=validate,
        base_model=base_model,
    ).info


def register_adapter(
    session: Session,
    store: ObjectStore,
    *,
    tenant_id: str,
    name: str,
    files_dir: Path,
    validate: Callable[[Path], AdapterSummary],
    base_model: str,
) -> Registration:
    """Validate the files, store them, then record the next version as ready to serve.

    `validate` is `adapters.validation.validate_adapter` with the served base model's shapes and
    limits bound (functools.partial); its ValueError becomes InvalidAdapter. Files byte-identical to
    the name's latest ready version (same sha256 of config and weights) add no version: that version
    is returned with `is_new=False`.
    Raises InvalidName, Conflict (the name is the served base model's), InvalidAdapter (validator's
    ValueError, missing files), NotFound (tenant not active), QuotaExceeded, StoreUnavailable,
    IntegrityError (files changed during registration), Conflict (lost the version race
    `_MAX_VERSION_TRIES` times).
    """
    check_name("adapter", name)
    if name == base_model:  # `model` would name both; the base model always wins there
        raise Conflict(
            f"adapter name {name!r} is the name of the served base model; choose another adapter name"
        )
    files_dir = Path(files_dir)
    try:
        summary = validate(files_dir)
    except ValueError as e:
        raise InvalidAdapter(str(e)) from e
    for filename in (CONFIG_FILE, WEIGHTS_FILE):  # the validator's messages come first
        if not (files_dir / filename).is_file():
            raise InvalidAdapter(f"upload has no {filename}; expected {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        same = _identical_latest(session, tenant_id=tenant_id, name=name, summary=summary)
    finally:
        session.rollback()
    if same is not None:
        return Registration(same, is_new=False)
    # Fail early, before any upload; checked again in the insert transaction. Ending the
    # transaction here means no lock or snapshot is held during the uploads.
    try:
        _check_tenant_and_quota(session, tenant_id=tenant_id, name=name, size_bytes=summary.size_bytes)
    finally:
        session.rollback()

    config_sha256 = put_content(store, files_dir / CONFIG_FILE)
    weights_sha256 = put_content(store, files_dir / WEIGHTS_FILE)
    if (weights_sha256, config_sha256) != (summary.sha256, summary.config_sha256):
        raise IntegrityError(
            f"adapter {name!r}: files changed during registration: stored sha256 {weights_sha256} / "
            f"{config_sha256}, validated {summary.sha256} / {summary.config_sha256}"
        )
    for _ in range(_MAX_VERSION_TRIES):
        try:
            _check_tenant_and_quota(session, tenant_id=tenant_id, name=name, size_bytes=summary.size_bytes)
            row = AdapterVersion(
                tenant_id=tenant_id,
                name=name,
                version=_next_version(session, tenant_id=tenant_id, name=name),
                base_model=base_model,
                status=AdapterStatus.READY.value,
                sha256=weights_sha256,
                config_sha256=config_sha256,
                size_bytes=summary.size_bytes,
                max_rank=summary.max_rank,
                ranks={str(k): int(v) for k, v in summary.ranks.items()},
                modules=list(summary.modules),
                coverage=None if summary.coverage is None else summary.coverage.as_json(),
            )
            session.add(row)
            session.commit()
        except SAIntegrityError:
            # Another registration took this version number first: retry with the next one.
            session.rollback()
            logger.debug(
                "adapter %s/%s: version taken by a concurrent registration, retrying", tenant_id, name
            )
            continue
        except BaseException:
            session.rollback()
            raise
        logger.info("registered adapter %s/%s@%d sha256=%s", tenant_id, name, row.version, weights_sha256)
        return Registration(AdapterVersionInfo.from_row(row), is_new=True)
    raise Conflict(f"adapter {name!r}: lost {_MAX_VERSION_TRIES} version races in a row; retry the upload")


def _identical_latest(
    session: Session, *, tenant_id: str, name: str, summary: AdapterSummary
) -> AdapterVersionInfo | None:
    """The name's latest ready version when it holds exactly these files (an active tenant's)."""
    row = session.scalars(
        select(AdapterVersion)
        .join(Tenant, Tenant.id == AdapterVersion.tenant_id)
        .where(
            Tenant.status == TenantStatus.ACTIVE.value,
            AdapterVersion.tenant_id == tenant_id,
            AdapterVersion.name == name,
            AdapterVersion.status == AdapterStatus.READY.value,
        )
        .order_by(AdapterVersion.version.desc())
        .limit(1)
    ).first()
    if row is None or (row.sha256, row.config_sha256) != (summary.sha256, summary.config_sha256):
        return None
    return AdapterVersionInfo.from_row(row)


def _next_version(session: Session, *, tenant_id: str, name: str) -> int:
    # Deleted versions count: a version number is never reused for different bytes.
    latest = session.scalar(
        select(func.max(AdapterVersion.version)).where(
            AdapterVersion.tenant_id == tenant_id, AdapterVersion.name == name
        )
    )
    return (latest or 0) + 1


def _check_tenant_and_quota(session: Session, *, tenant_id: str, name: str, size_bytes: int) -> None:
    tenant = session.get(Tenant, tenant_id)
    if tenant is None or tenant.status != TenantStatus.ACTIVE.value:
        raise NotFound("tenant", tenant_id)
    live = (AdapterVersion.tenant_id == tenant_id, AdapterVersion.status == AdapterStatus.READY.value)
    if tenant.max_adapters is not None:
        names = set(session.scalars(select(AdapterVersion.name).where(*live).distinct()))
        if name not in names and len(names) + 1 > tenant.max_adapters:
            raise QuotaExceeded("max_adapters", len(names) + 1, tenant.max_adapters)
    if tenant.max_adapter_bytes is not None:
        stored = session.scalar(select(func.coalesce(func.sum(AdapterVersion.size_bytes), 0)).where(*live))
        if int(stored) + size_bytes > tenant.max_adapter_bytes:
            raise QuotaExceeded("max_adapter_bytes", int(stored) + size_bytes, tenant.max_adapter_bytes)


def parse_model(model: str) -> tuple[str, int | None]:
    """ "name" -> (name, None); "name@3" -> (name, 3). ValueError for anything else."""
    name, at, version = model.partition("@")
    if not at:
        return name, None
    if not (version.isascii() and version.isdigit()) or not 1 <= int(version) <= MAX_VERSION:
        raise ValueError(f"adapter version must be an integer in [1, {MAX_VERSION}] in {model!r}")
    return name, int(version)


@transactional
def resolve_adapter(session: Session, *, tenant_id: str, model: str) -> AdapterVersionInfo:
    """The tenant's ready version named by `model` ("name" = latest ready, "name@3" = that one).

    NotFound, with the same message, for unknown names, other tenants' names, deleted versions and
    tenants that are not active.
    """
    try:
        name, version = parse_model(model)
    except ValueError as e:
        raise NotFound("adapter", model) from e
    query = (
        select(AdapterVersion)
        .join(Tenant, Tenant.id == AdapterVersion.tenant_id)
        .where(
            Tenant.status == TenantStatus.ACTIVE.value,
            AdapterVersion.tenant_id == tenant_id,
            AdapterVersion.name == name,
            AdapterVersion.status == AdapterStatus.READY.value,
        )
    )
    if version is not None:
        query = query.where(AdapterVersion.version == version)
    row = session.scalars(query.order_by(AdapterVersion.version.desc()).limit(1)).first()
    if row is None:
        raise NotFound("adapter", model)
    return AdapterVersionInfo.from_row(row)


@transactional
def list_adapters(
    session: Session, *, tenant_id: str | None = None, name: str | None = None, include_deleted: bool = False
) -> list[AdapterVersionInfo]:
    """Adapter versions ordered by (tenant, name, version); all tenants when `tenant_id` is None."""
    query = select(AdapterVersion).order_by(
        AdapterVersion.tenant_id, AdapterVersion.name, AdapterVersion.version
    )
    if tenant_id is not None:
        query = query.where(AdapterVersion.tenant_id == tenant_id)
    if name is not None:
        query = query.where(AdapterVersion.name == name)
    if not include_deleted:
        query = query.where(AdapterVersion.status == AdapterStatus.READY.value)
    return [AdapterVersionInfo.from_row(row) for row in session.scalars(query)]


@transactional
def get_adapter(session: Session, *, tenant_id: str, name: str) -> list[AdapterVersionInfo]:
    """The ready versions of one of the tenant's adapters; NotFound when there are none."""
    versions = list_adapters(session, tenant_id=tenant_id, name=name)
    if not versions:
        raise NotFound("adapter", name)
    return versions


@transactional
def delete_adapter(
    session: Session, *, tenant_id: str, name: str, version: int | None = None
) -> list[AdapterVersionInfo]:
    """Soft-delete all ready versions of `name` (or just `version`); they stop resolving at once.
    Objects stay in the store (other versions or tenants may share the bytes)."""
    query = select(AdapterVersion).where(
        AdapterVersion.tenant_id == tenant_id,
        AdapterVersion.name == name,
        AdapterVersion.status == AdapterStatus.READY.value,
    )
    if version is not None:
        query = query.where(AdapterVersion.version == version)
    rows = list(session.scalars(query.order_by(AdapterVersion.version)))
    if not rows:
        raise NotFound("adapter", name if version is None else f"{name}@{version}")
    now = utcnow()
    for row in rows:
        row.status = AdapterStatus.DELETED.value
        row.deleted_at = now
    return [AdapterVersionInfo.from_row(row) for row in rows]
