"""Liveness and readiness probes (unauthenticated, as orchestrators expect).

Both are `async` and touch no thread pool: `/health` (liveness) looks only at this process; `/ready`
awaits its dependency probes (api/http/blocking.py: single-flight, in their own pool) for at most
`ready_timeout_s` each, so neither can queue behind hung uploads, a hung object store or database, or
a saturated worker pool.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from api.deps import StateDep
from api.errors import APIError, responses

router = APIRouter(tags=["health"])


@router.get("/health", response_model=None, responses=responses())
async def health(state: StateDep) -> dict[str, Any] | JSONResponse:
    """Liveness: the process answers HTTP and its engine thread is alive and not failing every step
    (a dead engine cannot recover by itself: the orchestrator should restart the process)."""
    if not state.engine.is_healthy:
        return APIError(503, "engine is not healthy", code="engine_unhealthy").response()
    return {"status": "ok"}


@router.api_route("/ping", methods=["GET", "POST"], response_model=None, responses=responses())
async def ping(state: StateDep) -> Response:
    """vLLM's (and SageMaker's) liveness probe: 200 with an empty body, 503 as /health when the engine
    is not healthy."""
    if not state.engine.is_healthy:
        return APIError(503, "engine is not healthy", code="engine_unhealthy").response()
    return Response(status_code=200)


@router.get("/version", responses=responses())
async def version() -> dict[str, str]:
    """The server's version, as vLLM's `/version`."""
    return {"version": importlib.metadata.version("loraserve")}


@router.get("/ready", response_model=None, responses=responses())
async def ready(state: StateDep) -> dict[str, Any] | JSONResponse:
    """Readiness, with every dependency reported under `checks`: 503 (naming what is not ready) while
    draining, when the engine is not running or the database does not answer within
    `ready_timeout_s`; 200 otherwise, `"status": "degraded"` when only the object store is down
    (the base model and loaded adapters still serve; uploads and new adapter loads get 503)."""
    timeout_s = state.settings.ready_timeout_s
    names = list(state.ready_probes)
    results = await asyncio.gather(*(state.ready_probes[n].run(timeout_s) for n in names))
    checks: dict[str, Any] = {"engine": {"ok": state.engine_is_running}}
    for name, result in zip(names, results, strict=True):
        checks[name] = {"ok": result.ok, "detail": result.detail, "seconds": round(result.seconds, 3)}
    problem = None
    if state.admission.is_draining:
        problem = "draining: the server is shutting down"
    elif not state.engine_is_running:
        problem = "engine is not running"
    elif not checks["database"]["ok"]:
        problem = f"database unreachable: {checks['database']['detail']}"
    if problem is not None:
        error = APIError(503, problem, code="not_ready")
        return JSONResponse({**error.body(), "checks": checks}, status_code=503, headers={"Retry-After": "5"})
    status = "ready" if all(c["ok"] for c in checks.values()) else "degraded"
    return {"status": status, "model": state.model_name, "checks": checks}
