"""Liveness and readiness probes (unauthenticated, as orchestrators expect)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from api.deps import StateDep
from api.errors import APIError

router = APIRouter(tags=["health"])


@router.get("/health")
def health() -> dict[str, Any]:
    """The process answers HTTP."""
    return {"status": "ok"}


@router.get("/ready", response_model=None)
def ready(state: StateDep) -> dict[str, Any] | JSONResponse:
    """Engine loaded and stepping, database reachable, not draining; 503 naming what is not ready."""
    if state.admission.is_draining:
        return APIError(503, "draining: the server is shutting down", code="not_ready").response()
    if not state.engine_is_running:
        return APIError(503, "engine is not running", code="not_ready").response()
    try:
        with state.sessions() as session:
            session.execute(text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001 - any database failure means "not ready"
        return APIError(503, f"database unreachable: {type(exc).__name__}", code="not_ready").response()
    return {"status": "ready", "model": state.model_name}
