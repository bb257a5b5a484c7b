"""Every error leaves the server in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

All four keys are always present (null when unknown), as the OpenAI spec requires; status codes
follow the OpenAI client's mapping (../shared/reference/platform.md, section 1.4). Schema errors
in a JSON body become 400 `invalid_request_error` naming the field; a body that is not JSON is 422.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
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

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


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

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

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
        return APIError(503, f"object store unavailable: {exc}", code="store_unavailable")
    return APIError(500, f"internal error: {type(exc).__name__}", code="internal_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return APIError(422, f"request body is not valid JSON: {first.get('msg')}", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    else:
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return APIError(400, message, param=param, code="invalid_value")


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

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error: %s", exc)
        return APIError(
            500, f"internal server error ({type(exc).__name__})", code="internal_error"
        ).response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
