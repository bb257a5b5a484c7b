"""What the server knows about one API request while it runs, and the usage it is billed for.

A `RequestContext` is created once per HTTP request; its `request_id` is the response `id`, the
`X-Request-Id` header and the engine request id (suffixed `-<choice>` when one HTTP request becomes
several engine requests: n > 1 or a list of prompts). When the last of its engine requests ends,
`InFlight` (api/inference/inflight.py) hands the context and the final outputs to the meter, which
bills `compute_usage(finals, n=ctx.n)`: the same function that builds the response's `usage` object.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from base_engine.outputs import RequestOutput
from registry.provenance import Provenance
from registry.types import TenantInfo, TenantQuotas

RequestKind = Literal["completion", "chat"]
ID_PREFIX: dict[RequestKind, str] = {"completion": "cmpl", "chat": "chatcmpl"}


@dataclass(frozen=True, slots=True)
class AssignedId:
    """The request id a fleet ingress chose (api/fleet/routing.py): `<prefix>-<client's X-Request-Id>`
    when the client sent a well-formed one, else random."""

    request_id: str
    is_retry: bool = False  # sent again: the replica tried first went away before answering


# Set only by a fleet replica (api/fleet/replica.py) to what its ingress chose, never from a client
# header: a retry on another replica keeps its id, so usage ON CONFLICT (tenant, id) bills it once.
assigned_request_id: ContextVar[AssignedId | None] = ContextVar("assigned_request_id", default=None)


def new_request_id(kind: RequestKind, client_id: str | None = None) -> str:
    """The fleet ingress's id, else `<prefix>-<client's X-Request-Id>` (api/inference/client_id.py),
    else `<prefix>-<32 random hex digits>`."""
    assigned = assigned_request_id.get()
    if assigned is not None and assigned.request_id.startswith(f"{ID_PREFIX[kind]}-"):
        return assigned.request_id
    return f"{ID_PREFIX[kind]}-{client_id or secrets.token_hex(16)}"


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated tenant and the public prefix of the key it used (for usage records, audit)."""

    tenant: TenantInfo
    key_prefix: str

    @property
    def actor(self) -> str:
        return f"key:{self.key_prefix}"


@dataclass(slots=True)
class RequestContext:
    request_id: str
    kind: RequestKind
    tenant_id: str
    tenant_name: str
    key_prefix: str
    model: str  # as the client named it
    adapter_name: str | None = None  # None = the base model
    adapter_version: int | None = None
    user: str | None = None  # the request's OpenAI `user` (the tenant's end user), kept with its usage
    quotas: TenantQuotas = field(default_factory=TenantQuotas)  # the tenant's own (None = server default)
    num_prompts: int = 1
    n: int = 1  # choices per prompt
    num_prompt_tokens: int = 0  # over all prompts, each counted once
    max_new_tokens: int = 0  # sum of max_tokens over all choices (quota estimates)
    priority: int = 0  # its priority class (lower = more urgent; api/tenancy/priority.py)
    client_id: str | None = None  # the client's X-Request-Id (unique within its tenant only), if used
    created: int = field(default_factory=lambda: int(time.time()))
    created_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    engine_request_ids: list[str] = field(default_factory=list)  # index = choice index
    abort_reason: str | None = None  # "disconnect" | "timeout" | "shutdown" once aborted by the server
    response_headers: dict[str, str] = field(default_factory=dict)  # e.g. x-ratelimit-* set by quota checks
    usage: Usage | None = None  # what the response reported, once known
    provenance: Provenance | None = (
        None  # what produces the answer (api/inference/provenance.py), set when planned
    )
    # Called with the billed usage when the request ends in the engine (admission's quota release).
    on_end: list[Callable[[Usage], None]] = field(default_factory=list)

    @property
    def estimated_tokens(self) -> int:
        """Upper bound of the tokens this request can bill: its prompts plus every choice's max_tokens."""
        return self.num_prompt_tokens + self.max_new_tokens

    @property
    def num_choices(self) -> int:
        return self.num_prompts * self.n

    @property
    def header_id(self) -> str:
        """The response's `X-Request-Id`: the client's own, echoed, else the request id."""
        return self.client_id or self.request_id

    @property
    def engine_key(self) -> str:
        """Unique across tenants: a client's X-Request-Id is unique only within its tenant, so the
        engine (and InFlight) key its requests by the id and the tenant."""
        return self.request_id if self.client_id is None else f"{self.request_id}@{self.tenant_id}"

    def engine_request_id(self, index: int) -> str:
        return self.engine_key if self.num_choices == 1 else f"{self.engine_key}-{index}"


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def compute_usage(finals: Sequence[RequestOutput], *, n: int) -> Usage:
    """Usage of one HTTP request from its engine requests' final outputs, in choice order.

    Each prompt is billed once (its first choice's length and prefix-cache hits), as OpenAI bills
    `n`; completion tokens are summed over every choice.
    """
    if n < 1 or len(finals) % n:
        raise ValueError(f"expected a multiple of n={n} final outputs, got {len(finals)}")
    firsts = finals[::n]
    return Usage(
        prompt_tokens=sum(o.num_prompt_tokens for o in firsts),
        completion_tokens=sum(o.num_completion_tokens for o in finals),
        cached_tokens=sum(o.num_cached_tokens for o in firsts),
    )
