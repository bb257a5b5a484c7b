"""Console authentication: admin key -> login session cookie; CSRF token on every state change.

Only a session cookie opens the console (OWASP Session Management cheat sheet); API keys in an
`Authorization` header never do, so a tenant key gets 401 here just as on `/admin/api`. Every POST
carries the session's synchronizer token (OWASP CSRF Prevention cheat sheet) as the form field
`csrf_token` or the `X-CSRF-Token` header, and a cross-origin `Origin` header is refused outright.
"""

from __future__ import annotations

import hmac
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import Depends, Request
from fastapi.responses import Response

from api.admin.console.core import ConsoleDep
from api.admin.console.sessions import COOKIE_NAME, COOKIE_PATH, ConsoleSession
from api.errors import APIError

CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
TENANT_KEY_SCHEME = "lsk-"


class LoginRequired(Exception):
    """A browser asked for a console page without a session: send it to the login page."""

    def __init__(self, next_path: str) -> None:
        super().__init__(next_path)
        self.next_path = next_path


def check_admin_key(admin_key: str, key: str) -> None:
    """Raise APIError 403 for a tenant key, 401 for anything but `admin_key`."""
    key = key.strip()
    if key.startswith(TENANT_KEY_SCHEME):
        raise APIError(403, "Tenant API keys cannot sign in to the admin console.", code="tenant_key_refused")
    if not key or not hmac.compare_digest(key.encode(), admin_key.encode()):
        raise APIError(401, "Incorrect admin key.", code="invalid_admin_key")


def safe_next(path: str | None) -> str:
    """Where to go after login: only a console path on this server (no open redirect)."""
    if path and path.startswith("/admin") and not path.startswith("//") and "\\" not in path:
        return path
    return "/admin"


def set_session_cookie(request: Request, response: Response, session: ConsoleSession) -> None:
    response.set_cookie(
        COOKIE_NAME,
        session.id,
        path=COOKIE_PATH,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def clear_session_cookie(response: Response) -> None:
    response.delete_cookie(COOKIE_NAME, path=COOKIE_PATH, httponly=True, samesite="strict")


def current_session(request: Request, console: ConsoleDep) -> ConsoleSession:
    session = console.sessions.get(request.cookies.get(COOKIE_NAME))
    if session is not None:
        return session
    is_page = request.method == "GET" and "text/html" in request.headers.get("accept", "")
    if is_page and "authorization" not in request.headers:
        query = f"?{request.url.query}" if request.url.query else ""
        raise LoginRequired(request.url.path + query)
    raise APIError(
        401,
        "The admin console needs a login session (sign in at /admin/login); API keys are not accepted here.",
        code="login_required",
    )


LoginDep = Annotated[ConsoleSession, Depends(current_session)]


async def check_csrf(request: Request, session: LoginDep) -> ConsoleSession:
    origin = request.headers.get("origin")
    if origin and origin != "null" and urlsplit(origin).netloc != request.headers.get("host"):
        raise APIError(403, f"cross-origin request from {origin!r} refused", code="csrf_failed")
    token = request.headers.get(CSRF_HEADER)
    if token is None and request.headers.get("content-type", "").startswith(
        ("application/x-www-form-urlencoded", "multipart/form-data")
    ):
        value = (await request.form()).get(CSRF_FIELD)
        token = value if isinstance(value, str) else None
    if not session.csrf_matches(token):
        raise APIError(403, "missing or wrong CSRF token: reload the page and try again", code="csrf_failed")
    return session


CsrfDep = Annotated[ConsoleSession, Depends(check_csrf)]
