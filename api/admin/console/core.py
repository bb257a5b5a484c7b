"""The console's collaborators (given at construction), its own state (sessions, goodput window,
alarm rules, templates) and page rendering.

Pages are server-rendered Jinja2 (autoescaped) with a strict Content-Security-Policy: scripts and
styles only from /admin/static, no inline script or style, no framing, forms post only here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from api.admin.console.alarms import AlarmConfig
from api.admin.console.goodput import GoodputWindow
from api.admin.console.sessions import ConsoleSession, SessionStore
from api.fleet.snapshot import ThisReplica
from api.fleet.sync import FleetSync
from api.metrics.prometheus import Metrics
from api.tenancy.admission import Admission
from api.tenant_adapters.views import Residency
from base_engine.async_engine import AsyncEngine
from registry.disk_cache import DiskTier

HERE = Path(__file__).parent
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",  # pages may show a new key once; never keep them in a cache
}


def human_bytes(num: float | None) -> str:
    if num is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num) < 1024 or unit == "TiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    raise AssertionError("unreachable")


def seconds(value: float | None) -> str:
    """Latency for people: "12 ms" below a second, "1.25 s" above (static/console.js formats alike)."""
    if value is None:
        return "–"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def percent(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.1f}%"


def utc_time(ts: int | float | None) -> str:
    if ts is None:
        return "–"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M UTC")


def make_templates() -> Jinja2Templates:
    templates = Jinja2Templates(directory=HERE / "templates")
    templates.env.filters["bytes"] = human_bytes
    templates.env.filters["utc"] = utc_time
    templates.env.filters["secs"] = seconds
    templates.env.filters["pct"] = percent
    templates.env.filters["thousands"] = lambda n: f"{int(n):,}" if n is not None else "–"
    return templates


@dataclass(frozen=True, slots=True)
class ConsoleServices:
    """What the console's pages and actions work with, besides a database session per request."""

    admin_key: str  # the one key that signs in
    engine: AsyncEngine
    admission: Admission
    disk: DiskTier  # the local adapter tier (Overview's residency)
    metrics: Metrics | None  # the metrics ring behind Overview's charts (None: live gauges only)
    max_cpu_loras: int
    residency: Residency
    replica: ThisReplica  # the Fleet page in single-process mode
    fleet_sync: FleetSync  # pin, unpin, delete and tenant status reach every replica
    flush_usage: Callable[[], None]  # the usage meter's buffer into the database (APIError 503 if not)


@dataclass
class Console:
    services: ConsoleServices
    goodput: GoodputWindow = field(default_factory=GoodputWindow)
    alarms: AlarmConfig = field(default_factory=AlarmConfig)
    sessions: SessionStore = field(default_factory=SessionStore)
    templates: Jinja2Templates = field(default_factory=make_templates)

    def page(
        self,
        request: Request,
        template: str,
        *,
        session: ConsoleSession | None,
        status_code: int = 200,
        **context: Any,
    ) -> HTMLResponse:
        """Render `template` with the session's CSRF token and pending flash messages."""
        context |= {
            "csrf_token": session.csrf_token if session else "",
            "flashes": session.pop_flashes() if session else [],
            "is_logged_in": session is not None,
            "path": request.url.path,
        }
        response = self.templates.TemplateResponse(request, template, context, status_code=status_code)
        response.headers.update(SECURITY_HEADERS)
        return response


async def get_console(request: Request) -> Console:
    # async: resolved on the event loop, not in anyio's worker pool (a sync dependency would be).
    return request.app.state.console


ConsoleDep = Annotated[Console, Depends(get_console)]
