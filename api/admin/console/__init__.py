"""Admin web console under `/admin`: tenants, adapters, live engine dashboard, usage.

Server-rendered Jinja2 pages with a little JavaScript (charts drawn as inline SVG by
static/charts.js: no third-party code, nothing fetched at run time). `install_console(app, console)`
mounts the router, the login redirect, and the goodput window fed by the engine's finished requests;
the `Console` is built with its collaborators at start-up (api/bootstrap.py `build_console`).
"""

from __future__ import annotations

from urllib.parse import urlencode

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import RedirectResponse, Response

from api.admin.console import actions, pages
from api.admin.console.alarms import AlarmConfig
from api.admin.console.auth import LoginRequired
from api.admin.console.core import Console
from api.admin.console.goodput import GoodputWindow, Slo

router = APIRouter(tags=["console"], include_in_schema=False)
router.include_router(pages.router)
router.include_router(actions.router)

__all__ = ["AlarmConfig", "Console", "GoodputWindow", "Slo", "install_console", "router"]


def install_console(app: FastAPI, console: Console) -> Console:
    """Mount the console on `app`; its goodput window listens to every finished engine request."""
    app.state.console = console
    console.services.engine.on_finished.append(console.goodput.observe)

    async def to_login(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, LoginRequired)
        return RedirectResponse(f"/admin/login?{urlencode({'next': exc.next_path})}", status_code=303)

    app.add_exception_handler(LoginRequired, to_login)
    app.include_router(router)
    return console
