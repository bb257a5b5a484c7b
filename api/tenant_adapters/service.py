"""Adapter REST service functions (tenant side): upload, list, inspect, delete.

Upload: the body is streamed into a temporary directory (api/tenant_adapters/uploads.py; 408 when
it is not in by its deadline), then the registry validates it against the served base model
(`adapters.validation`) *before* anything is stored and records a ready version; 201 is sent only
then. At most `max_concurrent_uploads` uploads run at once, at most
`max_concurrent_uploads_per_tenant` of one tenant (one more: 429 + Retry-After, before its body is
read; api/tenant_adapters/upload_gate.py); validation, the object store and the database work of an
upload run in the upload pool (api/http/blocking.py), never on the event loop, the engine thread or
anyio's shared pool, and an upload that takes longer than `upload_timeout_s` gets 504 (its worker
still ends on the store's own timeouts, and only then frees its slot and its files).

Reads and deletes are scoped to the caller's tenant: another tenant's adapter is the same 404 as an
unknown name.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from fastapi import Request
from sqlalchemy.orm import Session

from api.context import Caller
from api.errors import APIError, from_registry_error
from api.tenant_adapters.registrar import Registrar
from api.tenant_adapters.upload_gate import TenantUploadGate, UploadRefusal
from api.tenant_adapters.uploads import receive_adapter_upload
from api.tenant_adapters.views import Residency, adapter_views, version_view
from registry.adapters import Registration, delete_adapter, get_adapter, list_adapters, register_adapter
from registry.audit import record_audit
from registry.errors import RegistryError
from registry.fleet import delete_adapter as fleet_delete_adapter

logger = logging.getLogger(__name__)

UPLOAD_RETRY_AFTER_S = 5


def _load_malloc_trim() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_malloc_trim = _load_malloc_trim()


def _register(registrar: Registrar, caller: Caller, name: str, files_dir: Path) -> Registration:
    with registrar.sessions() as session:
        registration = register_adapter(
            session,
            registrar.store,
            tenant_id=caller.tenant.id,
            name=name,
            files_dir=files_dir,
            validate=registrar.validate,
            base_model=registrar.base_model,
        )
        info = registration.info
        record_audit(
            session,
            actor=caller.actor,
            action="adapter.upload",
            tenant_id=caller.tenant.id,
            target=f"{info.name}@{info.version}",
            detail={"sha256": info.sha256, "size": info.size_bytes, "is_new": registration.is_new},
        )
    return registration


def register_in_worker(registrar: Registrar, caller: Caller, name: str, files_dir: Path) -> Registration:
    """Register the two PEFT files in `files_dir` as `name` of the caller's tenant (in the upload pool)."""
    try:
        return _register(registrar, caller, name, files_dir)
    finally:
        if _malloc_trim is not None:
            _malloc_trim(0)  # hand freed validation buffers back to the OS now, not at some later peak


async def upload_adapter(
    *, registrar: Registrar, request: Request, caller: Caller
) -> tuple[dict[str, Any], bool]:
    """The stored version's view and whether it is new (False: identical to the latest version)."""

    async def receive(tmp: Path) -> tuple[str, Callable[[], Registration]]:
        name = await receive_adapter_upload(request, tmp, limits=registrar.limits, executor=registrar.pool)
        return name, lambda: register_in_worker(registrar, caller, name, tmp)

    registration = await run_registration(
        registrar, receive, tenant_id=caller.tenant.id, what="upload", on_error=_upload_error
    )
    return version_view(registration.info, residency=registrar.residency), registration.is_new


def _upload_error(exc: RegistryError) -> APIError:
    error = from_registry_error(exc)
    if error.status == 503:
        error.headers.setdefault("Retry-After", str(UPLOAD_RETRY_AFTER_S))
    return error


async def run_registration(
    registrar: Registrar,
    prepare: Callable[[Path], Awaitable[tuple[str, Callable[[], Registration]]]],
    *,
    tenant_id: str,
    what: str,
    on_error: Callable[[RegistryError], APIError],
) -> Registration:
    """One upload-like registration (multipart upload, import by reference) in an upload slot of
    `tenant_id`: 429 when the tenant or the server holds all it may; `prepare(tmp)` fills a private
    temporary directory and returns (name, the worker's job); the job runs in the upload pool, waited
    for at most `upload_timeout_s` (504; the worker then finishes on its own), and the slot and the
    directory are released whenever the worker ends."""
    gate, timeout_s = registrar.gate, registrar.timeout_s
    refusal = gate.try_enter(tenant_id)
    if refusal is not None:
        raise _too_many_uploads(gate, refusal)
    uploads = registrar.uploads_dir
    tmp: Path | None = None
    job: Future[Registration] | None = None
    try:
        uploads.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=uploads))
        name, work = await prepare(tmp)
        job = registrar.pool.submit(work)
        job.add_done_callback(lambda _: _finish_upload(gate, tenant_id, tmp))  # whenever the worker ends
        result = asyncio.wrap_future(job)
        result.add_done_callback(lambda f: f.cancelled() or f.exception())  # read even if nobody waits
        try:
            # shield: on timeout or disconnect only the wait ends; the worker finishes on its own.
            return await asyncio.wait_for(asyncio.shield(result), timeout_s)
        except TimeoutError:
            logger.warning("adapter %s %r: no result after %.0f s", what, name, timeout_s)
            raise APIError(
                504,
                f"the {what} was not stored within {timeout_s:g} s (the object store or "
                "database is slow or unreachable); retry later",
                code="upload_timeout",
                headers={"Retry-After": str(UPLOAD_RETRY_AFTER_S)},
            ) from None
        except RegistryError as exc:
            raise on_error(exc) from None
    finally:
        if job is None:  # never handed to a worker: clean up here
            _finish_upload(gate, tenant_id, tmp)


def _too_many_uploads(gate: TenantUploadGate, refusal: UploadRefusal) -> APIError:
    if refusal is UploadRefusal.TENANT:
        message = (
            f"{gate.per_tenant} adapter uploads of this tenant are in progress, the most one tenant may "
            "run at once; retry later"
        )
    else:
        message = (
            f"{gate.server.limit} adapter uploads are in progress, the most this server takes at once; "
            "retry later"
        )
    return APIError(429, message, code="too_many_uploads", headers={"Retry-After": str(UPLOAD_RETRY_AFTER_S)})


def _finish_upload(gate: TenantUploadGate, tenant_id: str, tmp: Path | None) -> None:
    try:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        gate.leave(tenant_id)


def list_own_adapters(*, session: Session, residency: Residency, caller: Caller) -> list[dict[str, Any]]:
    return adapter_views(list_adapters(session, tenant_id=caller.tenant.id), residency=residency)


def get_own_adapter(*, session: Session, residency: Residency, caller: Caller, name: str) -> dict[str, Any]:
    try:
        versions = get_adapter(session, tenant_id=caller.tenant.id, name=name)
    except RegistryError as exc:
        raise from_registry_error(exc) from None
    return adapter_views(versions, residency=residency)[0]


def delete_own_adapter(
    *, session: Session, caller: Caller, name: str, version: int | None, is_fleet: bool = False
) -> dict[str, Any]:
    # A fleet: the delete and its fleet event in one transaction, so every replica evicts it.
    delete = fleet_delete_adapter if is_fleet else delete_adapter
    try:
        deleted = delete(session, tenant_id=caller.tenant.id, name=name, version=version)
    except RegistryError as exc:
        raise from_registry_error(exc) from None
    record_audit(
        session,
        actor=caller.actor,
        action="adapter.delete",
        tenant_id=caller.tenant.id,
        target=name if version is None else f"{name}@{version}",
    )
    return {
        "object": "adapter.deleted",
        "name": name,
        "versions": [d.version for d in deleted],
        "deleted": True,
    }
