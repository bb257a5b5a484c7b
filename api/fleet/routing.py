"""The ingress's routing identity: which adapter (tenant + name + version) a request will run on.

Ray Serve's multiplexing routes a request to a replica that already holds its model id
(`handle.options(multiplexed_model_id=...)`); here that id is the engine's adapter id
(`AdapterVersionInfo.ref_id`, `<tenant id>/<adapter>@<version>`), so two tenants' adapters with the
same name never share an id and a new version is a new id.

The router reads only what routing needs (the JSON body's `model`, the bearer key) and resolves them
through the registry with a small TTL cache: one database round trip per (key, model) per `ttl_s`.
It authorizes nothing: a bad key, an unknown model or a stale cache entry only routes the request to
some replica, which authenticates and resolves again and answers 401/404 itself.
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

from api.context import RequestKind, new_request_id
from registry.adapters import resolve_adapter
from registry.errors import AuthError, NotFound
from registry.keys import authenticate

logger = logging.getLogger(__name__)

# POST paths whose `model` decides the replica; the kind names the request id's prefix (None: no id).
ROUTED_PATHS: dict[str, RequestKind | None] = {
    "/v1/completions": "completion",
    "/v1/chat/completions": "chat",
    "/tokenize": None,
}


@dataclass(frozen=True, slots=True)
class Route:
    model_id: str | None  # Ray's multiplexed model id; None = any replica (Ray's least loaded)
    request_id: str | None  # chosen here so a retry on another replica bills under the same id
    is_idempotent: bool  # safe to send again to another replica when nothing reached the client


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
        self._cache: OrderedDict[tuple[str, str], tuple[float, str | None]] = OrderedDict()
        self.num_lookups = 0  # registry round trips (tests: the cache works)

    def route(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Route:
        kind = ROUTED_PATHS.get(path) if method == "POST" else None
        is_inference = method == "POST" and path in ROUTED_PATHS
        request_id = new_request_id(kind) if kind is not None else None
        # Inference is repeatable (same request id: billed once); GETs are; other writes are not.
        is_idempotent = is_inference or method in ("GET", "HEAD", "OPTIONS")
        if not is_inference or not self.affinity:
            return Route(None, request_id, is_idempotent)
        model, api_key = _model_and_key(headers, body)
        model_id = None
        if model is not None and api_key is not None and model != self.base_model:
            model_id = self.model_id(api_key, model)
        return Route(model_id, request_id, is_idempotent)

    def model_id(self, api_key: str, model: str) -> str | None:
        """The adapter's model id, or None (base model, bad key, unknown model: any replica)."""
        key = (hashlib.sha256(api_key.encode()).hexdigest(), model)
        now = self.clock()
        cached = self._cache.get(key)
        if cached is not None and cached[0] > now:
            self._cache.move_to_end(key)
            return cached[1]
        model_id = self._lookup(api_key, model)
        # A miss is kept briefly: an adapter uploaded a moment ago soon routes by affinity too.
        self._cache[key] = (now + (self.ttl_s if model_id is not None else min(self.ttl_s, 5.0)), model_id)
        self._cache.move_to_end(key)
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
        return model_id

    def _lookup(self, api_key: str, model: str) -> str | None:
        self.num_lookups += 1
        try:
            with self.sessions() as session:
                tenant = authenticate(session, api_key=api_key)
                info = resolve_adapter(session, tenant_id=tenant.id, model=model)
        except (AuthError, NotFound):
            return None
        except Exception:  # noqa: BLE001 - a registry outage only costs affinity; the replica answers
            logger.warning("routing lookup failed; sending the request to any replica", exc_info=True)
            return None
        return info.ref_id  # the engine's own adapter id: one name for the same thing


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
