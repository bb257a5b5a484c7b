"""Authentication before the body: a request to a route that takes a key and a body gets its 401
before one byte of the body is read or parsed.

FastAPI reads and parses a JSON body before it resolves the route's dependencies, authentication
included. Measured before this guard: 20-40 concurrent 4.4 MB JSON bodies with a forged key pushed
`/health` to 2.9-4.7 s, the event loop busy parsing bodies it then refused. `KeyGuard` runs the
route's key check on the headers alone (`GuardedRoute.check`: raises the route's own 401
`APIError`), answers the refusal with `Connection: close` (the unread body makes the connection
unusable), and otherwise hands the request on untouched. It sits outside `BodyLimit`, so a refused
body is not even buffered. Which routes it guards, and with which check, is decided where the app is
put together (api/app.py); nothing here knows what a key is.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import APIError


@dataclass(frozen=True, slots=True)
class GuardedRoute:
    path: re.Pattern[str]  # the route's path_regex
    methods: frozenset[str]
    check: Callable[[Request], Awaitable[None]]  # raises the 401 APIError; reads headers only


class KeyGuard:
    def __init__(self, app: ASGIApp, routes: Sequence[GuardedRoute]) -> None:
        self.app = app
        self.routes = tuple(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            route = self._route(scope["method"], scope["path"])
            if route is not None:
                try:
                    await route.check(Request(scope))  # no `receive`: the body cannot be touched
                except APIError as exc:
                    await exc.response({"Connection": "close"})(scope, receive, send)
                    return
        await self.app(scope, receive, send)

    def _route(self, method: str, path: str) -> GuardedRoute | None:
        for route in self.routes:
            if method in route.methods and route.path.match(path):
                return route
        return None
