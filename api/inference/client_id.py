"""A client's own request id: the `X-Request-Id` header, used when it is well-formed and unique to
its tenant (as `vllm serve` takes it; issue 29, "Chat details").

Form: 1-128 characters of `A-Z a-z 0-9 . _ : -` (what tracing systems put there: UUIDs, ULIDs,
`trace:span`). With it the request is named by it everywhere: the response's `X-Request-Id` header
echoes it, the response `id` is `chatcmpl-<id>` (`cmpl-<id>` for completions, `resp_<id>` for
responses), the usage record and the logs use that same `id`. Refused before anything runs:
- a malformed header: 400 `invalid_request_id`, naming the header and the form;
- an id its tenant already used (in flight, or already billed): 409 `request_id_in_use`
  (`api.errors.request_id_in_use`; planning checks the usage table, admission the meter). Another
  tenant's use of the same id is no conflict: usage is keyed by (tenant, request id) (migration 0009),
  and the engine keys the request by the id and the tenant (`RequestContext.engine_key`).
Through a fleet the ingress reads the header too (api/fleet/routing.py): a well-formed id becomes the
id it assigns (`is_well_formed`), so every replica and a retry on another one use it; the ingress
refuses an id its tenant has in flight on any replica, the replica one already billed.
"""

from __future__ import annotations

import re

from fastapi import Request

from api.errors import APIError

HEADER = "X-Request-Id"
MAX_CHARS = 128
_FORM = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_CHARS}}}")


def is_well_formed(raw: str) -> bool:
    return _FORM.fullmatch(raw) is not None


def client_request_id(request: Request) -> str | None:
    """The request's `X-Request-Id` when it sent one; 400 when that is not of the documented form."""
    raw = request.headers.get(HEADER)
    if raw is None:
        return None
    if not is_well_formed(raw):
        shown = raw if len(raw) <= 40 else raw[:40] + "..."
        raise APIError(
            400,
            f"{HEADER} must be 1-{MAX_CHARS} characters of A-Z, a-z, 0-9, '.', '_', ':' or '-'; got "
            f"{shown!r} ({len(raw)} characters)",
            param=HEADER,
            code="invalid_request_id",
        )
    return raw
