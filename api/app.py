"""The FastAPI application: routes, OpenAI-shaped errors, and the engine's life cycle.

`create_app(state)` takes a ready `AppState` (api/bootstrap.py builds one from settings; tests may
build their own). The lifespan registers the in-flight requests as the engine's observer, starts the
engine thread (and, in a fleet, the replica agent) and, on shutdown, drains, stops each service by
name (`shut_down`: usage written, quotas' pending releases, pools, adapter fetches, the fleet agent,
the registry database's connections), stops the engine and closes it (its adapter loader's threads).
The SIGTERM drain itself lives in api/server.py.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker
from starlette.routing import BaseRoute

from api.admin.console import install_console
from api.bootstrap import build_console
from api.deps import get_caller, precheck_admin, precheck_caller, require_admin
from api.errors import install_error_handlers
from api.http.body_limit import BodyLimit
from api.http.key_alias import KeyAlias
from api.http.key_guard import GuardedRoute, KeyGuard
from api.routes import adapter_import, adapters, admin, health, openai, tokenize, usage, vllm_lora
from api.server import run
from api.state import AppState

logger = logging.getLogger(__name__)


def create_app(state: AppState, *, extra_routers: Sequence[APIRouter] = ()) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Ends each HTTP request once its engine requests have (metering, metrics): api/inference/inflight.py
        state.engine.on_finished.append(state.inference.inflight.on_engine_finished)
        state.engine.start()
        if state.settings.fleet and state.fleet_agent is None:  # join the fleet (heartbeat, events)
            from api.fleet.agent import start_agent

            state.fleet_agent = start_agent(
                state.replica,
                metrics=state.metrics,
                db_url=state.settings.db_url,
                wakeup=state.fleet_sync.wakeup,
            )
        logger.info("serving %s (max_model_len %d)", state.model_name, state.max_model_len)
        try:
            yield
        finally:
            await drain(state, timeout_s=0.0)
            await shut_down(state)
            state.engine.shutdown()
            state.engine.close()  # this app owns the engine: its adapter loader's threads end here
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
    routers = (*routers, adapter_import.router, vllm_lora.router, *extra_routers)
    for router in routers:
        app.include_router(router)
    # Outside BodyLimit: a body sent with a key its route refuses is never read, let alone parsed.
    app.add_middleware(KeyGuard, routes=guarded_routes(r for router in routers for r in router.routes))
    install_console(app, build_console(state))  # the admin web console under /admin (its README.md)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    if state.static_key_alias is not None:  # outermost: every layer below sees the issued key
        static_key, issued_key = state.static_key_alias
        app.add_middleware(KeyAlias, static_key=static_key, issued_key=issued_key)
    return app


def guarded_routes(routes: Iterable[BaseRoute]) -> list[GuardedRoute]:
    """The routes that take a body and a key, each with the check of its key that needs no body
    (the routers' own routes: they carry their prefix, and are included without another)."""
    prechecks = {get_caller: precheck_caller, require_admin: precheck_admin}
    guarded = []
    for route in routes:
        if not isinstance(route, APIRoute) or route.body_field is None:
            continue
        calls = _dependency_calls(route.dependant)
        check = next((pre for dep, pre in prechecks.items() if dep in calls), None)
        if check is not None:
            guarded.append(GuardedRoute(route.path_regex, frozenset(route.methods), check))
    return guarded


def _dependency_calls(dependant: Dependant) -> set[Any]:
    calls, stack = set(), [dependant]
    while stack:
        node = stack.pop()
        calls.add(node.call)
        stack.extend(node.dependencies)
    return calls


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
        state.inference.inflight.abort_all("shutdown", state.engine.abort)
        # Give the handlers a moment to send their final events / error responses.
        grace = loop.time() + 5.0
        while state.admission.num_in_flight and loop.time() < grace:
            await asyncio.sleep(poll_s)


async def shut_down(state: AppState) -> None:
    """After the drain (every admitted request has finished), before the engine stops: each service
    stops once, in this order; one that fails is logged and the others still stop."""
    inference = state.inference
    steps: list[tuple[str, Callable[[], object]]] = [
        ("blocking pools", state.pools.shutdown),
        ("metrics sampler", state.metrics_sampler.stop),
        ("usage meter", inference.meter.stop),  # writes every finished request's record
        ("quotas", inference.quotas.stop),  # the database backend writes its pending releases
    ]
    if inference.adapter_fetch is not None:
        steps.append(("adapter fetches", inference.adapter_fetch.shutdown))
    if state.fleet_agent is not None:
        steps.append(("fleet agent", state.fleet_agent.stop))  # leaves the fleet, closes its database
    steps.append(("registry database", lambda: _dispose_database(state.sessions)))  # after every writer
    for name, stop in steps:
        try:
            result = stop()
            if inspect.isawaitable(result):
                await result
        except Exception:  # noqa: BLE001 - one failing service must not keep the others running
            logger.exception("stopping the %s failed", name)


def _dispose_database(sessions: sessionmaker[Session]) -> None:
    """Close the pooled connections of the database engine the sessions are bound to."""
    bind = sessions.kw.get("bind")
    if isinstance(bind, Engine):
        bind.dispose()


def run_server(state: AppState) -> None:
    """Run the app under uvicorn until a signal drains it (api/server.py); returns normally."""

    async def drain_for(timeout_s: float) -> None:
        await drain(state, timeout_s=timeout_s)

    run(create_app(state), settings=state.settings, admission=state.admission, drain=drain_for)
