"""The collaborators of the inference services (completions, tokenization), built once by
api/bootstrap.py and handed to the routes by api/deps.py's `InferenceDep`."""

from __future__ import annotations

from dataclasses import dataclass, field

from api.inference.adapter_defaults import AdapterDefaults
from api.inference.adapter_fetch import AdapterFetch
from api.inference.inflight import InFlight
from api.inference.limits import RequestLimits
from api.inference.sampling import SeedSource
from api.inference.stored_responses import StoredResponses
from api.metering.request_meter import Meter
from api.tenancy.admission import Admission
from api.tenancy.plan_gate import PlanGate
from api.tenancy.quota_gate import Quotas
from base_engine.async_engine import AsyncEngine
from registry.provenance import Provenance


@dataclass(frozen=True, slots=True, kw_only=True)
class Inference:
    engine: AsyncEngine  # the facade: tokenizer, limits, validate, generate, abort
    model_name: str  # the base model's served name (`model` in requests)
    server_secret: str  # keys each tenant's prefix-cache salt
    seeds: SeedSource  # for requests that send no seed (api/inference/sampling.py)
    provenance: Provenance | None  # the process-wide half of every answer's provenance
    is_deterministic: bool  # the server runs every request deterministically
    request_timeout_s: float
    limits: RequestLimits  # fan-out, stops and logprobs one request may ask for
    is_quota_blocking: bool  # quotas are a database transaction (a fleet): admit off the event loop
    quotas: Quotas
    meter: Meter
    admission: Admission  # the server's in-flight bound (shared with the drain and health)
    inflight: InFlight  # the engine requests now running; reports each request's end
    plan_gate: PlanGate  # per-tenant bound on requests being planned at once
    adapter_fetch: AdapterFetch | None  # fetches an adapter's files before admission
    tool_call_parser: str | None = None  # vLLM's --tool-call-parser: the tool syntax (None: the template's)
    # sampling defaults stored with adapters (api/inference/adapter_defaults.py; the demo tenant's)
    adapter_defaults: AdapterDefaults = field(default_factory=AdapterDefaults)
    # Responses API `store: true` / `previous_response_id` (None: both refused by name)
    stored_responses: StoredResponses | None = None
