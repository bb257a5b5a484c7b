"""The FastAPI application: routes, OpenAI-shaped errors, and the engine's life cycle.

`create_app(state)` takes a ready `AppState` (api/bootstrap.py builds one from settings; tests may
build their own). The lifespan starts the engine thread and, on shutdown, runs the drain hooks
(flush usage) and stops the engine. The SIGTERM drain itself lives in api/server.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi

from api.admin.console import install_console
from api.bootstrap import build_console
from api.errors import install_error_handlers
from api.http.body_limit import BodyLimit
from api.routes import adapter_import, adapters, admin, health, openai, tokenize, usage
from api.state import AppState

logger = logging.getLogger(__name__)


def create_app(state: AppState, *, extra_routers: Sequence[APIRouter] = ()) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Installed last, so every other on_finished callback (metering) still finds the context.
        state.engine.on_finished.append(state.inflight.on_engine_finished)
        state.engine.start()
        if state.settings.fleet and state.fleet_agent is None:  # join the fleet (heartbeat, events)
            from api.fleet.agent import start_agent

            state.fleet_agent = start_agent(
                state.replica,
                metrics=state.metrics,
                db_url=state.settings.db_url,
                wakeup=state.fleet_sync.wakeup,
            )
            state.on_drain.append(state.fleet_agent.stop)  # leaves the fleet, closes its database engine
        logger.info("serving %s (max_model_len %d)", state.model_name, state.max_model_len)
        try:
            yield
        finally:
            await drain(state, timeout_s=0.0)
            await state.run_drain_hooks()
            state.engine.shutdown()
            logger.info("engine stopped")

    app = FastAPI(title="loraserve", version="0.1.0", lifespan=lifespan)
    app.state.loraserve = state
    install_error_handlers(app)
    # Outermost of our own layers: a body past the limit never reaches FastAPI's reader.
    settings = state.settings
    app.add_middleware(
        BodyLimit, max_bytes=settings.max_request_body_bytes, timeout_s=settings.request_body_timeout_s
    )
    routers = (openai.router, tokenize.router, adapters.router, admin.router, health.router, usage.router)
    for router in (*routers, adapter_import.router, *extra_routers):
        app.include_router(router)
    install_console(app, build_console(state))  # the admin web console under /admin (its README.md)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document without the 422 it adds to every route with parameters: invalid input is
    400 here (api/errors.py), and each route lists the statuses it really returns (`responses=`)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        schemas = schema.get("components", {}).get("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
        app.openapi_schema = schema
    return app.openapi_schema


async def drain(state: AppState, *, timeout_s: float, poll_s: float = 0.05) -> None:
    """Stop admitting, let in-flight requests finish for up to `timeout_s`, then abort the rest."""
    state.admission.is_draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while state.admission.num_in_flight and loop.time() < deadline:
        await asyncio.sleep(poll_s)
    if state.admission.num_in_flight:
        state.inflight.abort_all("shutdown", state.engine.abort)
        # Give the handlers a moment to send their final events / error responses.
        grace = loop.time() + 5.0
        while state.admission.num_in_flight and loop.time() < grace:
            await asyncio.sleep(poll_s)
