"""Console form posts: each needs the login session and its CSRF token (`CsrfDep`).

Post/Redirect/Get: an action flashes its outcome into the session and answers 303 to the page it
came from. The two actions that create a key answer with a page showing the key instead, once:
the key is not kept anywhere (only its salted hash, by the registry) and the page is `no-store`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from api.admin import service as svc
from api.admin.console.auth import CsrfDep, clear_session_cookie
from api.admin.console.core import ConsoleDep
from api.admin.console.service import QUOTA_FIELDS, delete_adapter_version, parse_quotas
from api.admin.console.sessions import ConsoleSession
from api.deps import SessionDep
from api.errors import APIError
from registry.models import TenantStatus

router = APIRouter(prefix="/admin")


def _see_other(url: str) -> RedirectResponse:
    return RedirectResponse(url, status_code=303)


def _attempt(session: ConsoleSession, action: Callable[[], str], back: str) -> RedirectResponse:
    try:
        session.flash("ok", action())
    except APIError as exc:
        session.flash("error", exc.message)
    return _see_other(back)


@router.post("/logout")
def logout(console: ConsoleDep, session: CsrfDep) -> Response:
    console.sessions.drop(session.id)
    response = _see_other("/admin/login")
    clear_session_cookie(response)
    return response


@router.post("/tenants", response_class=HTMLResponse)
def create_tenant(
    request: Request, console: ConsoleDep, db: SessionDep, session: CsrfDep, name: Annotated[str, Form()] = ""
) -> Response:
    try:
        created = svc.create(db, name=name.strip(), quotas=None)
    except APIError as exc:
        session.flash("error", exc.message)
        return _see_other("/admin/tenants")
    return console.page(
        request, "key_once.html", session=session, tenant=created, api_key=created["api_key"], is_new=True
    )


@router.post("/tenants/{tenant_id}/keys", response_class=HTMLResponse)
def issue_key(
    tenant_id: str,
    request: Request,
    console: ConsoleDep,
    db: SessionDep,
    session: CsrfDep,
    label: Annotated[str, Form()] = "",
) -> Response:
    try:
        key = svc.new_key(db, tenant_id=tenant_id, label=label.strip() or None)
        tenant = svc.tenant(db, tenant_id=tenant_id)
    except APIError as exc:
        session.flash("error", exc.message)
        return _see_other(f"/admin/tenants/{tenant_id}")
    return console.page(
        request, "key_once.html", session=session, tenant=tenant, api_key=key["api_key"], is_new=False
    )


@router.post("/tenants/{tenant_id}/keys/{prefix}/revoke")
def revoke_key(tenant_id: str, prefix: str, db: SessionDep, session: CsrfDep) -> Response:
    def act() -> str:
        svc.revoke(db, tenant_id=tenant_id, prefix=prefix)
        return f"Key {prefix} revoked: it stopped working at once."

    return _attempt(session, act, f"/admin/tenants/{tenant_id}")


@router.post("/tenants/{tenant_id}/quotas")
async def set_quotas(tenant_id: str, request: Request, db: SessionDep, session: CsrfDep) -> Response:
    form = await request.form()
    fields = {k: str(form.get(k, "")) for k in QUOTA_FIELDS}

    def act() -> str:
        svc.set_quotas(db, tenant_id=tenant_id, quotas=parse_quotas(fields))
        return "Quotas saved."

    return _attempt(session, act, f"/admin/tenants/{tenant_id}")


@router.post("/tenants/{tenant_id}/priority")
def set_priority(
    tenant_id: str, db: SessionDep, session: CsrfDep, default_priority: Annotated[str, Form()] = ""
) -> Response:
    def act() -> str:
        raw = default_priority.strip()
        if not raw.lstrip("-").isdigit() or not raw.isascii():
            raise APIError(
                400, f"default priority must be a whole number, got {raw!r}", param="default_priority"
            )
        svc.set_priority(db, tenant_id=tenant_id, default_priority=int(raw))
        return f"Default priority set to {int(raw)}."

    return _attempt(session, act, f"/admin/tenants/{tenant_id}")


@router.post("/tenants/{tenant_id}/status")
def set_status(
    tenant_id: str, console: ConsoleDep, db: SessionDep, session: CsrfDep, status: Annotated[str, Form()] = ""
) -> Response:
    def act() -> str:
        try:
            new = TenantStatus(status)
        except ValueError:
            raise APIError(
                400, f"status must be one of {[s.value for s in TenantStatus]}, got {status!r}"
            ) from None
        info = svc.set_status(db, tenant_id=tenant_id, status=new, fleet_sync=console.services.fleet_sync)
        return f"Tenant {info['name']} is now {info['status']}."

    back = "/admin/tenants" if status == TenantStatus.DELETED else f"/admin/tenants/{tenant_id}"
    return _attempt(session, act, back)


@router.post("/adapters/{tenant_id}/{name}/{version}/{action}")
async def adapter_action(
    tenant_id: str,
    name: str,
    version: int,
    action: str,
    console: ConsoleDep,
    db: SessionDep,
    session: CsrfDep,
) -> Response:
    services = console.services
    try:
        if action in ("pin", "unpin"):
            await svc.pin(
                db,
                engine=services.engine,
                residency=services.residency,
                fleet_sync=services.fleet_sync,
                tenant_id=tenant_id,
                name=name,
                version=version,
                is_pin=action == "pin",
            )
            message = f"{name}@{version} {action}ned."
        elif action == "delete":
            target = await delete_adapter_version(
                db,
                engine=services.engine,
                fleet_sync=services.fleet_sync,
                tenant_id=tenant_id,
                name=name,
                version=version,
            )
            message = f"{target} deleted: it is no longer served."
        else:
            raise APIError(404, f"unknown adapter action {action!r}, expected pin, unpin or delete")
        session.flash("ok", message)
    except APIError as exc:
        session.flash("error", exc.message)
    return _see_other("/admin/adapters")
