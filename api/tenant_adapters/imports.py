"""Adapters by reference: register an adapter from an object-store prefix, no multipart.

`POST /v1/adapters/import` (tenant key) and `POST /admin/api/tenants/{id}/adapters/import` (admin key)
take `{"name", "uri"}`; `uri` must pass api/tenant_adapters/import_sources.py (the operator's bound
and the tenant's own prefixes, never the registry). A source belongs to the first tenant that imported
from it (`registry.import_grants`): another tenant's import of it is the same 404 as a source with no
objects, so "someone else's" and "nothing there" cannot be told apart. Then, like an upload
(api/tenant_adapters/service.py), in the same upload slots (the server's and the tenant's), pool and
`upload_timeout_s`, a worker of the upload pool:
1. opens the source with the registry's store opener (connect/read timeouts, bounded attempts);
2. reads each object's size (HEAD) and refuses one past the upload limits with 413 before
   downloading anything, then downloads both into a temporary directory (sizes checked again);
3. claims the source for the tenant, and registers the files through the upload's own path
   (`service.register_in_worker`), so fail-closed validation, quotas, the base-name refusal and
   identical-files dedupe all apply (a failed registration gives a new claim back).
Errors: a missing object is 404 naming it, an invalid adapter 400 `invalid_adapter` with the
validator's cause (as for an upload: this API answers invalid input with 400, never 422), an
unreachable store 503 + Retry-After; bodies never name the store's endpoint or the URI (api/errors.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api.context import Caller
from api.errors import APIError, from_registry_error
from api.settings import Settings
from api.tenant_adapters.import_sources import ImportSource, check_granted, check_local_object, check_source
from api.tenant_adapters.registrar import Registrar
from api.tenant_adapters.service import UPLOAD_RETRY_AFTER_S, register_in_worker, run_registration
from api.tenant_adapters.uploads import MAX_CONFIG_BYTES, UploadLimits
from api.tenant_adapters.views import version_view
from registry.adapters import Registration
from registry.errors import NotFound, ObjectNotFound, RegistryError
from registry.import_grants import (
    Claim,
    claim_import_source,
    get_import_prefixes,
    is_claimed_by_another,
    release_import_source,
)
from registry.models import TenantStatus
from registry.store import ObjectStore
from registry.stores import open_store
from registry.tenants import check_name, get_tenant
from registry.types import CONFIG_FILE, WEIGHTS_FILE

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AdminCaller(Caller):
    """The admin acting for a tenant (audit actor "admin")."""

    @property
    def actor(self) -> str:
        return "admin"


async def import_adapter(
    *, registrar: Registrar, settings: Settings, caller: Caller, name: str, uri: str
) -> tuple[dict[str, Any], bool]:
    """The registered version's view and whether it is new (False: identical to the latest version).
    `settings`: the allowed sources and the timeouts of the source's store."""
    return await _import(registrar, settings, caller.tenant.id, lambda: caller, name, uri)


async def import_adapter_for_tenant(
    *, registrar: Registrar, settings: Settings, tenant_id: str, name: str, uri: str
) -> tuple[dict[str, Any], bool]:
    """`import_adapter` by the admin into `tenant_id` (404 for an unknown or deleted tenant)."""
    return await _import(
        registrar, settings, tenant_id, lambda: _admin_caller(registrar, tenant_id), name, uri
    )


def _admin_caller(registrar: Registrar, tenant_id: str) -> Caller:
    with registrar.sessions() as session:
        tenant = get_tenant(session, tenant_id=tenant_id)
    if tenant.status != TenantStatus.ACTIVE.value:
        raise NotFound("tenant", tenant_id)
    return AdminCaller(tenant=tenant, key_prefix="")


async def _import(
    registrar: Registrar,
    settings: Settings,
    tenant_id: str,
    who: Callable[[], Caller],
    name: str,
    uri: str,
) -> tuple[dict[str, Any], bool]:
    try:
        check_name("adapter", name)  # before any download; registration checks it again
    except RegistryError as exc:
        raise from_registry_error(exc) from None
    source = check_source(settings, uri)

    async def prepare(tmp: Path) -> tuple[str, Callable[[], Registration]]:
        return name, lambda: _import_in_worker(registrar, settings, who, name, source, tmp)

    registration = await run_registration(
        registrar, prepare, tenant_id=tenant_id, what="import", on_error=import_error
    )
    return version_view(registration.info, residency=registrar.residency), registration.is_new


def _import_in_worker(
    registrar: Registrar,
    settings: Settings,
    who: Callable[[], Caller],
    name: str,
    source: ImportSource,
    tmp: Path,
) -> Registration:
    caller = who()
    tenant_id = caller.tenant.id
    resolve = source.scheme == "file"  # again with symlinks resolved, now that we are off the event loop
    if resolve:
        source = check_source(settings, source.uri, resolve=True)
        for key in (CONFIG_FILE, WEIGHTS_FILE):
            check_local_object(source, key)
    with registrar.sessions() as session:
        check_granted(source, get_import_prefixes(session, tenant_id=tenant_id), resolve=resolve)
        if is_claimed_by_another(session, tenant_id=tenant_id, source_uri=source.uri):
            raise _not_found()  # before any byte is read
    store = open_store(
        source.uri,
        max_attempts=settings.store_max_attempts,
        connect_timeout_s=settings.store_connect_timeout_s,
        read_timeout_s=settings.store_read_timeout_s,
    )
    download_adapter_files(store, tmp, registrar.limits)
    with registrar.sessions() as session:
        claim = claim_import_source(session, tenant_id=tenant_id, source_uri=source.uri)
    if claim is Claim.TAKEN:  # another tenant's import of it committed meanwhile
        raise _not_found()
    try:
        return register_in_worker(registrar, caller, name, tmp)
    except BaseException:
        if claim is Claim.NEW:
            with registrar.sessions() as session:
                release_import_source(session, tenant_id=tenant_id, source_uri=source.uri)
        raise


def _not_found() -> ObjectNotFound:
    """What a source with no adapter_config.json raises (`import_error` makes both the same 404)."""
    return ObjectNotFound("", CONFIG_FILE)


def download_adapter_files(store: ObjectStore, dest: Path, limits: UploadLimits) -> None:
    """Both PEFT files of `store` into `dest`, each refused with 413 past the upload limits, by its
    size before the download (and after it: the object may have been replaced in between)."""
    caps = {CONFIG_FILE: MAX_CONFIG_BYTES, WEIGHTS_FILE: limits.weights_bytes}
    sizes = {key: store.size(key) for key in caps}  # ObjectNotFound for a missing one
    for key, cap in caps.items():
        _check_size(key, sizes[key], cap)
    if sum(sizes.values()) > limits.body_bytes:
        raise _too_large("the adapter", sum(sizes.values()), limits.body_bytes)
    for key, cap in caps.items():
        store.get(key, dest / key)
        _check_size(key, (dest / key).stat().st_size, cap)


def _check_size(key: str, size: int, cap: int) -> None:
    if size > cap:
        raise _too_large(key, size, cap)


def _too_large(what: str, size: int, cap: int) -> APIError:
    return APIError(
        413, f"{what} is {size} bytes, more than this server's limit of {cap} bytes", code="payload_too_large"
    )


def import_error(exc: RegistryError) -> APIError:
    """The HTTP form of a registry error met while importing (see the module docstring)."""
    if isinstance(exc, ObjectNotFound):
        return APIError(
            404,
            f"the source has no object {exc.key}; expected {CONFIG_FILE} and {WEIGHTS_FILE} "
            "directly under uri",
            code="import_object_not_found",
            param="uri",
        )
    error = from_registry_error(exc)  # InvalidAdapter: 400 with the cause; StoreUnavailable: 503, logged
    if error.status == 503:
        error.headers["Retry-After"] = str(UPLOAD_RETRY_AFTER_S)
    return error
