"""The ingress's routing identity: which adapter (tenant + name + version) a request will run on.

Ray Serve's multiplexing routes a request to a replica that already holds its model id
(`handle.options(multiplexed_model_id=...)`); here that id is the engine's adapter id
(`AdapterVersionInfo.ref_id`, `<tenant id>/<adapter>@<version>`), so two tenants' adapters with the
same name never share an id and a new version is a new id.

The router reads only what routing needs (the JSON body's `model`, the bearer key) and resolves them
through the registry with a small TTL cache: one database round trip per (key, model) per `ttl_s`.
It authorizes nothing: a bad key, an unknown model or a stale cache entry only routes the request to
some replica, which authenticates and resolves again and answers 401/404 itself.

The request id: a client's well-formed `X-Request-Id` (api/inference/client_id.py; passed on as
`CLIENT_REQUEST_ID` by api/fleet/proxy_headers.py) becomes
`<prefix>-<that id>`, else a random one; the replica takes it as its own (`api.context.AssignedId`).
A malformed header gets a random id and the replica's 400 naming the header. `InFlightIds` is the
fleet-wide half of the 409 `request_id_in_use`: one replica sees only its own requests in flight.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sqlalchemy.orm import Session

from api.context import ID_PREFIX, RequestKind, new_request_id
from api.fleet.proxy_headers import CLIENT_REQUEST_ID
from api.inference.client_id import is_well_formed
from registry.adapters import resolve_adapter
from registry.errors import AuthError, NotFound
from registry.keys import authenticate

logger = logging.getLogger(__name__)

# POST paths whose `model` decides the replica; the kind names the request id's prefix (None: no id).
ROUTED_PATHS: dict[str, RequestKind | None] = {
    "/v1/completions": "completion",
    "/v1/chat/completions": "chat",
    "/tokenize": None,
    "/v1/responses": "chat",  # served as a chat completion; its id is `resp_<the chat id's tail>`
}


@dataclass(frozen=True, slots=True)
class Route:
    model_id: str | None  # Ray's multiplexed model id; None = any replica (Ray's least loaded)
    request_id: str | None  # chosen here so a retry on another replica bills under the same id
    is_idempotent: bool  # safe to send again to another replica when nothing reached the client
    client_id: str | None = None  # the client's X-Request-Id when request_id is made of it
    tenant_id: str | None = None  # the key's tenant, looked up only with a client id (None: bad key)


def parse_model_id(model_id: str) -> tuple[str, str]:
    """`<tenant id>/<name>@<version>` -> (tenant id, "name@version"), as `resolve_adapter` takes it."""
    tenant_id, slash, model = model_id.partition("/")
    if not slash or "@" not in model:
        raise ValueError(f"expected a model id '<tenant id>/<adapter>@<version>', got {model_id!r}")
    return tenant_id, model


class AdapterRouter:
    """`route(method, path, headers, body)` -> `Route`; registry lookups cached for `ttl_s`.

    `affinity=False` drops the model id (every request to the least-loaded replica): the baseline
    benchmarks/scale_out.py compares adapter loads against; never a production setting.
    """

    def __init__(
        self,
        sessions: Callable[[], Session],
        *,
        base_model: str,
        affinity: bool = True,
        ttl_s: float = 30.0,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sessions = sessions
        self.base_model = base_model
        self.affinity = affinity
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self._cache: OrderedDict[tuple[str, str, str], tuple[float, str | None]] = OrderedDict()
        self.num_lookups = 0  # registry round trips (tests: the cache works)

    def route(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Route:
        kind = ROUTED_PATHS.get(path) if method == "POST" else None
        is_inference = method == "POST" and path in ROUTED_PATHS
        client_id = _client_id(headers) if kind is not None else None
        request_id = new_request_id(kind) if kind is not None else None
        if client_id is not None and kind is not None:
            request_id = f"{ID_PREFIX[kind]}-{client_id}"
        # Inference is repeatable (same request id: billed once); GETs are; other writes are not.
        is_idempotent = is_inference or method in ("GET", "HEAD", "OPTIONS")
        if not is_inference:
            return Route(None, request_id, is_idempotent)
        model, api_key = _model_and_key(headers, body)
        tenant_id = self.tenant_id(api_key) if client_id is not None and api_key is not None else None
        model_id = None
        if self.affinity and model is not None and api_key is not None and model != self.base_model:
            model_id = self.model_id(api_key, model)
        return Route(model_id, request_id, is_idempotent, client_id, tenant_id)

    def model_id(self, api_key: str, model: str) -> str | None:
        """The adapter's model id, or None (base model, bad key, unknown model: any replica)."""
        return self._cached(("model", _digest(api_key), model), lambda: self._lookup(api_key, model))

    def tenant_id(self, api_key: str) -> str | None:
        """The key's tenant id, or None (bad key, registry outage: the replica answers)."""
        return self._cached(("tenant", _digest(api_key), ""), lambda: self._lookup(api_key, None))

    def _cached(self, key: tuple[str, str, str], lookup: Callable[[], str | None]) -> str | None:
        now = self.clock()
        cached = self._cache.get(key)
        if cached is not None and cached[0] > now:
            self._cache.move_to_end(key)
            return cached[1]
        value = lookup()
        # A miss is kept briefly: an adapter uploaded a moment ago soon routes by affinity too.
        self._cache[key] = (now + (self.ttl_s if value is not None else min(self.ttl_s, 5.0)), value)
        self._cache.move_to_end(key)
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
        return value

    def _lookup(self, api_key: str, model: str | None) -> str | None:
        """The adapter's engine id for `model`, or the key's tenant id when `model` is None."""
        self.num_lookups += 1
        try:
            with self.sessions() as session:
                tenant = authenticate(session, api_key=api_key)
                if model is None:
                    return tenant.id
                info = resolve_adapter(session, tenant_id=tenant.id, model=model)
        except (AuthError, NotFound):
            return None
        except Exception:  # noqa: BLE001 - a registry outage only costs affinity; the replica answers
            logger.warning("routing lookup failed; sending the request to any replica", exc_info=True)
            return None
        return info.ref_id  # the engine's own adapter id: one name for the same thing


class InFlightIds:
    """(tenant id, request id) of the requests with a client's id in flight through this ingress.

    A replica refuses an id already billed (the shared usage table) and one in flight on itself; this
    refuses one in flight on any replica. It holds for one ingress (deploy/ray-serve.yaml runs one).
    """

    def __init__(self) -> None:
        self._ids: set[tuple[str, str]] = set()

    def take(self, tenant_id: str, request_id: str) -> bool:
        """False when the tenant already has `request_id` in flight (nothing taken)."""
        if (tenant_id, request_id) in self._ids:
            return False
        self._ids.add((tenant_id, request_id))
        return True

    def give_back(self, tenant_id: str, request_id: str) -> None:
        self._ids.discard((tenant_id, request_id))

    def __len__(self) -> int:
        return len(self._ids)


def _digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def _client_id(headers: Mapping[str, str]) -> str | None:
    """The client's X-Request-Id when well-formed (a malformed one: the replica's 400 names it), as
    the proxy's middleware passed it on (Ray gives a request without one a UUID of its own)."""
    raw = headers.get(CLIENT_REQUEST_ID)
    return raw if raw is not None and is_well_formed(raw) else None


def _model_and_key(headers: Mapping[str, str], body: bytes) -> tuple[str | None, str | None]:
    """The body's `model` and the bearer key, or None where absent or malformed (the replica says why)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    api_key = token.strip() if scheme.lower() == "bearer" and token.strip() else None
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None, api_key
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return (model if isinstance(model, str) else None), api_key
