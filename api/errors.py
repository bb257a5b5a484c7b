"""Every error leaves the server in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

All four keys are always present (null when unknown), as the OpenAI spec requires; status codes
follow the OpenAI client's mapping (../shared/reference/platform.md, section 1.4). A body that is not
JSON, or not the schema, is 400 `invalid_request_error` (never FastAPI's 422), naming the field.

What a caller may learn from an error is decided here, in one place:
- a dependency that is down is 503 with `Retry-After` (every 503 carries one): the database
  (`database_unavailable`, from SQLAlchemy's connection errors), the object store
  (`store_unavailable`), an adapter whose weights cannot be fetched now (`adapter_unavailable`);
- messages never carry server paths, URLs (object-store endpoints, database hosts), object keys or
  internal ids: `redact` rewrites them in every body as a last line of defence, and the causes
  behind 5xx errors are logged, not sent.
`ERROR_RESPONSES` / `responses(...)` put the statuses each route really returns into /openapi.json.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException

from registry.errors import (
    AuthError,
    Conflict,
    InvalidAdapter,
    InvalidName,
    NotFound,
    QuotaExceeded,
    StoreUnavailable,
)

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # what a 503 tells clients to wait when its cause gives no better figure

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

# Internal detail that must not reach a caller, in the order they are rewritten.
_REDACTIONS = (
    (re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"`)]+"), "<url>"),  # endpoints, s3://, file://, DSNs
    (re.compile(r"(?<![\w/.-])(?:/[\w.@+-]+){2,}/?"), "<path>"),  # absolute paths (two or more parts)
    (re.compile(r"(?<![\w-])[0-9a-f]{32,}(?![\w-])"), "<id>"),  # tenant ids (uuid hex), sha256 keys
)


def redact(message: str) -> str:
    """`message` without server paths, URLs or internal ids (a caller's own words are left alone
    unless they look like one)."""
    for pattern, replacement in _REDACTIONS:
        message = pattern.sub(replacement, message)
    return message


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error (OpenAI's `ErrorResponse`)."""

    error: ErrorDetail


class APIError(Exception):
    """An error response; raise it anywhere on the request path."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,  # noqa: A002 - the OpenAI field name
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = dict(headers or {})
        if status == 503:
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_S))

    def body(self) -> dict[str, Any]:
        error = {"message": redact(self.message), "type": self.type, "param": self.param, "code": self.code}
        return {"error": error}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers={**self.headers, **(headers or {})})


def model_not_found(model: str) -> APIError:
    # Same message for "unknown" and "another tenant's": nothing reveals that the name exists.
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


def request_id_in_use(request_id: str) -> APIError:
    """409: the tenant already used this `X-Request-Id` (api/inference/client_id.py)."""
    return APIError(
        409,
        f"X-Request-Id {request_id!r} is already in use by this tenant (in flight or already billed); "
        "send a new id for every request",
        param="X-Request-Id",
        code="request_id_in_use",
    )


def database_unavailable() -> APIError:
    return APIError(503, "The database is unavailable; retry later.", code="database_unavailable")


def store_unavailable() -> APIError:
    return APIError(503, "The object store is unavailable; retry later.", code="store_unavailable")


def from_registry_error(exc: Exception) -> APIError:
    """The HTTP form of a registry error (a NotFound never says whose the object is)."""
    if isinstance(exc, NotFound):
        return APIError(404, str(exc), code=f"{exc.kind}_not_found")
    if isinstance(exc, InvalidName):
        return APIError(400, str(exc), code="invalid_name", param="name")
    if isinstance(exc, InvalidAdapter):
        return APIError(400, str(exc), code="invalid_adapter")
    if isinstance(exc, QuotaExceeded):
        return APIError(429, str(exc), code="quota_exceeded", param=exc.limit)
    if isinstance(exc, Conflict):
        return APIError(409, str(exc), code="conflict")
    if isinstance(exc, AuthError):
        return APIError(401, str(exc), code="invalid_api_key")
    if isinstance(exc, StoreUnavailable):
        logger.warning("object store unavailable: %s", exc)  # the endpoint and key stay in the log
        return store_unavailable()
    logger.error("registry error mapped to 500: %r", exc)
    return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")


def is_database_outage(exc: BaseException) -> bool:
    """SQLAlchemy's way of saying the database cannot be reached (not that a statement was wrong)."""
    if isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError):
        return True
    if isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated:
        return True
    return isinstance(exc, sa_exc.TimeoutError | sa_exc.DisconnectionError)  # pool exhausted, dropped


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return APIError(
            400,
            "We could not parse the JSON body of your request: send a JSON object with "
            "'Content-Type: application/json'.",
            code="invalid_json",
        )
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif param is None and tuple(first.get("loc", ())) == ("body",):
        message = "The request body must be a JSON object ('Content-Type: application/json')."
    else:
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return APIError(400, message, param=param, code="invalid_value")


# ---- the statuses routes document in /openapi.json ----------------------------------------------

_DESCRIPTIONS = {
    400: "Invalid request: bad JSON, a field out of range, an unknown field (named in `param`)",
    401: "Missing or wrong key",
    404: "No such object, or not yours",
    409: "Conflict with the current state",
    413: "Body larger than the server's limit",
    429: "Rate limit or quota exceeded (`Retry-After`)",
    500: "Internal error (the cause is in the server's log)",
    503: "A dependency is down, the server is overloaded or shutting down (`Retry-After`)",
    504: "The request ran past the server's timeout",
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text} for status, text in _DESCRIPTIONS.items()
}


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route: the given error statuses plus the 500 and 503 any route can give."""
    return {status: ERROR_RESPONSES[status] for status in sorted({*statuses, 500, 503})}


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return _validation_error(exc).response()

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        message = "Not found: no such route" if exc.status_code == 404 else str(exc.detail)
        code = {404: "unknown_route", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, message, code=code).response(dict(exc.headers or {}))

    async def on_database(request: Request, exc: Exception) -> JSONResponse:
        if is_database_outage(exc):
            logger.warning("database unavailable (%s %s): %s", request.method, request.url.path, exc)
            return database_unavailable().response()
        return await on_unexpected(request, exc)

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error: %s", exc)
        return APIError(
            500, f"internal server error ({type(exc).__name__})", code="internal_error"
        ).response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    for database_error in (sa_exc.DBAPIError, sa_exc.TimeoutError, sa_exc.DisconnectionError):
        app.add_exception_handler(database_error, on_database)
    app.add_exception_handler(Exception, on_unexpected)
