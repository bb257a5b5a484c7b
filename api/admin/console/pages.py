"""Console pages (GET) plus login and logout: thin routes over api/admin/console/data.py and overview.py."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from api.admin.console import data
from api.admin.console.auth import LoginDep, check_admin_key, safe_next, set_session_cookie
from api.admin.console.core import HERE, Console, ConsoleDep
from api.admin.console.overview import overview
from api.admin.console.sessions import COOKIE_NAME
from api.deps import SessionDep
from api.errors import APIError, from_registry_error
from api.fleet.views import fleet_view
from registry.errors import RegistryError

router = APIRouter(prefix="/admin")
STATIC = {"console.css": "text/css", "console.js": "text/javascript", "charts.js": "text/javascript"}


@router.get("/static/{name}", include_in_schema=False)
def static(name: str) -> FileResponse:
    if name not in STATIC:
        raise APIError(404, f"no static file {name!r}", code="unknown_route")
    headers = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
    return FileResponse(HERE / "static" / name, media_type=STATIC[name], headers=headers)


@router.get("/login", response_class=HTMLResponse)
def login_page(request: Request, console: ConsoleDep, next: str | None = None) -> Response:
    if console.sessions.get(request.cookies.get(COOKIE_NAME)) is not None:
        return RedirectResponse(safe_next(next), status_code=303)
    return console.page(request, "login.html", session=None, next=safe_next(next), error=None)


@router.post("/login", response_class=HTMLResponse)
def login(
    request: Request,
    console: ConsoleDep,
    admin_key: Annotated[str, Form()] = "",
    next: Annotated[str, Form()] = "/admin",
) -> Response:
    try:
        check_admin_key(console.services.admin_key, admin_key)
    except APIError as exc:
        return console.page(
            request,
            "login.html",
            session=None,
            next=safe_next(next),
            error=exc.message,
            status_code=exc.status,
        )
    console.sessions.drop(request.cookies.get(COOKIE_NAME))  # a fresh id at every login
    session = console.sessions.create()
    response = RedirectResponse(safe_next(next), status_code=303)
    set_session_cookie(request, response, session)
    return response


@router.get("", response_class=HTMLResponse)
def overview_page(request: Request, console: ConsoleDep, session: LoginDep) -> Response:
    snapshot = overview(console.services, console.goodput, console.alarms)
    return console.page(request, "overview.html", session=session, data=snapshot)


@router.get("/overview.json")
def overview_json(console: ConsoleDep, _: LoginDep) -> dict[str, Any]:
    return overview(console.services, console.goodput, console.alarms)


def _period(start: str | None, end: str | None) -> data.DateRange:
    try:
        return data.DateRange.parse(start, end)
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value", param="start") from None


async def _flush_usage(console: Console) -> None:
    """Usage pages include every request finished before them: flush the meter's buffer first."""
    await run_in_threadpool(console.services.flush_usage)


@router.get("/tenants", response_class=HTMLResponse)
async def tenants_page(request: Request, console: ConsoleDep, db: SessionDep, session: LoginDep) -> Response:
    await _flush_usage(console)
    period = data.DateRange.parse(None, None)
    rows = await run_in_threadpool(data.tenant_rows, db, period=period)
    return console.page(request, "tenants.html", session=session, rows=rows, period=period)


@router.get("/tenants/{tenant_id}", response_class=HTMLResponse)
async def tenant_page(
    tenant_id: str,
    request: Request,
    console: ConsoleDep,
    db: SessionDep,
    session: LoginDep,
    start: str | None = None,
    end: str | None = None,
) -> Response:
    await _flush_usage(console)
    period = _period(start, end)
    try:
        detail = await run_in_threadpool(data.tenant_detail, db, tenant_id=tenant_id, period=period)
    except RegistryError as exc:
        raise from_registry_error(exc) from None
    return console.page(request, "tenant.html", session=session, detail=detail, period=period)


@router.get("/adapters", response_class=HTMLResponse)
async def adapters_page(request: Request, console: ConsoleDep, db: SessionDep, session: LoginDep) -> Response:
    await _flush_usage(console)
    services = console.services
    rows = await run_in_threadpool(
        data.adapter_rows, db, engine=services.engine, residency=services.residency
    )
    return console.page(request, "adapters.html", session=session, rows=rows)


@router.get("/adapters/{tenant_id}/{name}/{version}", response_class=HTMLResponse)
async def adapter_page(
    request: Request,
    console: ConsoleDep,
    db: SessionDep,
    session: LoginDep,
    tenant_id: str,
    name: str,
    version: int,
) -> Response:
    """One adapter version: what its coverage report says it changes, layer by layer."""
    await _flush_usage(console)
    services = console.services
    try:
        detail = await run_in_threadpool(
            data.adapter_detail, db, engine=services.engine, residency=services.residency,
            tenant_id=tenant_id, name=name, version=version,
        )  # fmt: skip
    except RegistryError as exc:
        raise from_registry_error(exc) from None
    return console.page(request, "adapter.html", session=session, detail=detail)


@router.get("/fleet", response_class=HTMLResponse)
async def fleet_page(request: Request, console: ConsoleDep, db: SessionDep, session: LoginDep) -> Response:
    """Replicas and what each holds; in single-process mode this process alone."""
    fleet = await run_in_threadpool(fleet_view, db, replica=console.services.replica)
    return console.page(request, "fleet.html", session=session, fleet=fleet, now=int(time.time()))


@router.get("/usage", response_class=HTMLResponse)
async def usage_page(
    request: Request,
    console: ConsoleDep,
    db: SessionDep,
    session: LoginDep,
    start: str | None = None,
    end: str | None = None,
    tenant_id: Annotated[str | None, Query()] = None,
) -> Response:
    await _flush_usage(console)
    period = _period(start, end)
    tenant_id = tenant_id or None
    report = await run_in_threadpool(data.usage_report, db, period=period, tenant_id=tenant_id)
    tenants = await run_in_threadpool(data.tenant_rows, db, period=period)
    return console.page(request, "usage.html", session=session, report=report, tenants=tenants)


@router.get("/usage.csv")
async def usage_csv(
    console: ConsoleDep,
    db: SessionDep,
    _: LoginDep,
    start: str | None = None,
    end: str | None = None,
    tenant_id: str | None = None,
    group_by: Literal["day", "adapter", "key", "tenant"] = "tenant",
) -> Response:
    await _flush_usage(console)
    period = _period(start, end)
    body = await run_in_threadpool(
        data.usage_csv, db, period=period, group_by=group_by, tenant_id=tenant_id or None
    )
    filename = f"usage-{period.start}-{period.end}-by-{group_by}.csv"
    headers = {"Content-Disposition": f'attachment; filename="{filename}"', "Cache-Control": "no-store"}
    return Response(body, media_type="text/csv; charset=utf-8", headers=headers)
