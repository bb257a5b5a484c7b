"""vLLM's `--api-key`: one static key that acts as an issued key of one tenant
(api/tenancy/static_tenant.py). A request whose `Authorization` is `Bearer <static key>` is handed on
with the tenant's issued key instead; every other request passes untouched. Outermost, so the key
guard, authentication, quotas and metering all see the issued key."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send


class KeyAlias:
    def __init__(self, app: ASGIApp, *, static_key: str, issued_key: str) -> None:
        self.app = app
        self._static = f"Bearer {static_key}".encode()
        self._issued = f"Bearer {issued_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            for i, (name, value) in enumerate(headers):
                if name == b"authorization" and hmac.compare_digest(value, self._static):
                    headers = [*headers[:i], (name, self._issued), *headers[i + 1 :]]
                    scope = {**scope, "headers": headers}
                    break
        await self.app(scope, receive, send)
