"""Start-up: from `Settings` to a ready `AppState` (database migrated, store checked, engine loaded).

Order matters for a fresh machine: data dir -> migrations on `--db` -> object store -> disk tier ->
model (downloaded / converted / made on first use: api/checkpoints/sources.py) -> secrets -> engine -> demo
tenant. It is the one place that builds the services and hands each its collaborators (the request
path's in `Inference`: usage meter, quotas, admission, in-flight requests, plan gate, seeds). Also the
start-up banner: base URL, keys and a ready-to-paste curl line.
"""

from __future__ import annotations

import functools
import json
import logging
import shlex
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from api.admin.console.core import Console, ConsoleServices
from api.admin.console.sessions_db import open_session_store
from api.checkpoints.sources import record_served_model, resolve_model_dir
from api.demo.tenant import ensure_demo_checkpoint, ensure_demo_tenant
from api.demo.traits import TRAITS
from api.fleet.start import check_fleet_schema, check_fleet_settings, fleet_server_secret
from api.inference.adapter_fetch import AdapterFetch
from api.inference.inflight import InFlight
from api.inference.limits import RequestLimits
from api.inference.provenance import server_provenance
from api.inference.sampling import SeedSource
from api.inference.services import Inference
from api.inference.stored_responses import StoredResponses
from api.inference.tool_parser import TOOL_FORMATS
from api.metering.request_meter import open_meter
from api.metrics.prometheus import Metrics
from api.metrics.sampler import MetricsSampler
from api.routes.usage import flush_usage
from api.settings import Settings
from api.state import AppState
from api.tenancy.admission import Admission
from api.tenancy.keyfiles import (
    ADMIN_KEY_FILE,
    SERVER_SECRET_FILE,
    make_private_database,
    make_private_dir,
    new_admin_key,
    read_or_create_secret,
)
from api.tenancy.plan_gate import PlanGate
from api.tenancy.quota_gate import TenantQuotaGate
from api.tenancy.quotas_db import open_limiter
from api.tenancy.static_tenant import StaticTenantError, ensure_static_tenant
from base_engine.async_engine import AsyncEngine
from base_engine.engine import LLMEngine
from base_engine.identity import describe_engine
from base_engine.model.config import load_model_config
from migrations.api import upgrade
from registry.db import make_engine, session_factory
from registry.disk_cache import DiskTier
from registry.provenance import Provenance
from registry.store import ObjectStore
from registry.stores import open_store
from registry.types import TenantQuotas

logger = logging.getLogger(__name__)


class StartError(Exception):
    """The server cannot start for a reason its operator can fix (an unsupported checkpoint, a limit the
    model cannot meet): the CLI prints the message alone and exits with status 2."""


def checked_model(settings: Settings) -> Path:
    """`resolve_model`, with its config read (architecture, shapes) so a checkpoint we cannot serve is
    refused before anything else starts."""
    try:
        model_dir = resolve_model(settings)
        load_model_config(model_dir)
    except ValueError as exc:
        raise StartError(str(exc)) from None
    return model_dir


def resolve_model(settings: Settings) -> Path:
    """The checkpoint directory `--model` names, made on first use: downloaded, converted from GGUF,
    or the random demo model written into the data dir."""
    if settings.is_random_demo:
        return ensure_demo_checkpoint(settings.demo_model_dir)
    return resolve_model_dir(settings.model_source, models_dir=settings.models_path)


def build_state(settings: Settings) -> AppState:
    check_fleet_settings(settings)  # a fleet replica: PostgreSQL + S3 + provided admin key, or refuse
    data_dir = make_private_dir(settings.data_dir)  # 0700: keys, database, journal, adapters
    model_dir = checked_model(settings)  # fails fast: before migrations, registry and secrets
    check_tool_call_parser(settings.tool_call_parser)
    chat_template = chat_template_text(settings.chat_template) if settings.chat_template else None
    make_private_database(settings.db_url)
    if settings.fleet:
        check_fleet_schema(settings)  # migrations run once per deploy (`loraserve db upgrade`)
    else:
        upgrade(settings.db_url)
    sessions, store = _open_registry(settings)
    disk = DiskTier(data_dir / "adapter-cache", store, settings.disk_cache_bytes)
    adapter_fetch = AdapterFetch(disk, wait_s=settings.adapter_fetch_wait_s)
    record_served_model(data_dir, settings.model_source)
    admin_key, admin_created, server_secret = _secrets(settings, data_dir)
    try:
        engine = LLMEngine(
            model_dir,
            device=settings.device,
            dtype=settings.dtype,
            config=settings.engine_config(),
            fetch=adapter_fetch,
        )
    except ValueError as exc:  # e.g. a max_model_len the model cannot reach
        raise StartError(str(exc)) from None
    if chat_template is not None:  # before anything renders a chat or reads the template's tool syntax
        engine.tokenizer.chat_template = chat_template
    async_engine = AsyncEngine(engine)
    provenance = server_provenance(
        model_dir=model_dir,
        base_model=settings.model_name,
        identity=describe_engine(engine),
        cache_dir=data_dir,
    )
    metrics = _metrics(settings, async_engine)
    inference = _inference(
        settings,
        sessions,
        engine=async_engine,
        metrics=metrics,
        server_secret=server_secret,
        provenance=provenance,
        adapter_fetch=adapter_fetch,
    )
    sampler = MetricsSampler(metrics=metrics, engine=async_engine, disk=disk)
    sampler.start()
    state = AppState(
        settings=settings,
        engine=async_engine,
        sessions=sessions,
        store=store,
        disk=disk,
        admin_key=admin_key,
        server_secret=server_secret,
        model_name=settings.model_name,
        base_shapes=load_model_config(model_dir).base_shapes(),
        inference=inference,
        metrics=metrics,
        metrics_sampler=sampler,
        admin_key_created=admin_created,
    )
    if settings.is_demo:
        state.demo = ensure_demo_tenant(
            sessions=sessions,
            store=store,
            data_dir=data_dir,
            shapes=state.base_shapes,
            validate=state.validator(),
            base_model=state.model_name,
            random_adapters=settings.is_random_demo,
        )
        for name, fields in state.demo.generation_defaults.items():
            inference.adapter_defaults.set(state.demo.tenant_id, name, fields)
    if settings.lora_modules or settings.static_api_key is not None:  # `vllm serve` flags
        try:
            issued = ensure_static_tenant(
                sessions=sessions,
                store=store,
                data_dir=data_dir,
                tenant=settings.static_tenant,
                lora_modules=settings.lora_modules,
                validate=state.validator(),
                base_model=state.model_name,
            )
        except StaticTenantError as exc:
            raise StartError(str(exc)) from None
        if settings.static_api_key is not None:
            state.static_key_alias = (settings.static_api_key.get_secret_value(), issued)
    return state


def _open_registry(settings: Settings) -> tuple[sessionmaker[Session], ObjectStore]:
    """The database's sessions and the object store, checked reachable."""
    sessions = session_factory(
        make_engine(
            settings.db_url,
            timeout_s=settings.db_timeout_s,
        )
    )
    store = open_store(
        settings.registry_url,
        max_attempts=settings.store_max_attempts,
        connect_timeout_s=settings.store_connect_timeout_s,
        read_timeout_s=settings.store_read_timeout_s,
    )
    store.check()
    return sessions, store


def _secrets(settings: Settings, data_dir: Path) -> tuple[str, bool, str]:
    """(admin key, whether it was created now, server secret)."""
    if settings.admin_key is not None:
        admin_key, admin_created = settings.admin_key.get_secret_value(), False
    else:
        admin_key, admin_created = read_or_create_secret(data_dir / ADMIN_KEY_FILE, new_admin_key)
    if settings.fleet:  # one secret for every replica, from the deploy's admin key; no file
        server_secret = fleet_server_secret(admin_key)
    else:
        server_secret, _ = read_or_create_secret(data_dir / SERVER_SECRET_FILE, lambda: new_admin_key()[4:])
    return admin_key, admin_created, server_secret


def _metrics(settings: Settings, engine: AsyncEngine) -> Metrics:
    metrics = Metrics(
        model_name=settings.model_name,
        max_model_len=engine.max_model_len,
        tenant_labels=settings.metrics_tenant_labels,
    )
    kv_cache = engine.kv_cache
    metrics.set_cache_config(
        block_size=kv_cache.block_size,
        num_gpu_blocks=kv_cache.num_blocks,
        cache_dtype="auto",  # the KV cache has the model's dtype, vLLM's "auto"
        enable_prefix_caching=kv_cache.enable_prefix_caching,
    )
    return metrics


def _inference(
    settings: Settings,
    sessions: sessionmaker[Session],
    *,
    engine: AsyncEngine,
    metrics: Metrics,
    server_secret: str,
    provenance: Provenance,
    adapter_fetch: AdapterFetch,
) -> Inference:
    """The request path's collaborators: the usage meter (replaying a crashed run's journal first),
    the tenants' quotas (a fleet's live in the database), the server's admission bound."""
    meter = open_meter(sessions, data_dir=settings.data_dir, flush_interval_s=settings.usage_flush_interval_s)
    defaults = TenantQuotas(
        rpm=settings.default_rpm, tpm=settings.default_tpm, max_concurrent=settings.default_max_concurrent
    )
    return Inference(
        engine=engine,
        model_name=settings.model_name,
        server_secret=server_secret,
        seeds=SeedSource(server_secret, settings.seed),
        provenance=provenance,
        is_deterministic=settings.deterministic,
        request_timeout_s=settings.request_timeout_s,
        limits=RequestLimits(
            max_choices=settings.max_choices_per_request,
            max_logprob_entries=settings.max_logprob_entries_per_response,
            max_stop_strings=settings.max_stop_strings,
            max_stop_string_chars=settings.max_stop_string_chars,
            max_stop_token_ids=settings.max_stop_token_ids,
        ),
        is_quota_blocking=settings.fleet,
        quotas=TenantQuotaGate(open_limiter(settings, sessions, defaults)),
        meter=meter,
        admission=Admission(
            settings.max_in_flight,
            fair=settings.fair_admission,
            reserve=settings.admission_reserve,
            max_queue_len=settings.max_queue_len,
        ),
        inflight=InFlight(meter=meter, metrics=metrics),
        plan_gate=PlanGate(settings.max_concurrent_plans_per_tenant),
        adapter_fetch=adapter_fetch,
        tool_call_parser=settings.tool_call_parser,
        stored_responses=StoredResponses(sessions, retention_s=settings.response_retention_s),
    )


def check_tool_call_parser(name: str | None) -> None:
    """vLLM's --tool-call-parser names one of our tool syntaxes (or auto: the template's)."""
    if name is not None and name not in (*TOOL_FORMATS, "auto"):
        raise StartError(f"--tool-call-parser {name!r} is not served; expected one of {list(TOOL_FORMATS)}")


def chat_template_text(value: str) -> str:
    """vLLM's --chat-template: the text of the file it names, else the value itself when it looks like a
    Jinja template."""
    path = Path(value)
    if "{" not in value and "\n" not in value:
        try:
            return path.read_text()
        except OSError as exc:
            raise StartError(f"--chat-template {value!r}: cannot read the file ({exc.strerror})") from None
    return value


def build_console(state: AppState) -> Console:
    """The admin console with its collaborators; a fleet's login sessions live in the database (any
    replica serves them; restarts keep them)."""
    services = ConsoleServices(
        admin_key=state.admin_key,
        engine=state.engine,
        admission=state.admission,
        disk=state.disk,
        metrics=state.metrics,
        max_cpu_loras=state.settings.max_cpu_loras,
        residency=state.residency,
        replica=state.replica,
        fleet_sync=state.fleet_sync,
        flush_usage=functools.partial(flush_usage, state),
    )
    return Console(services=services, sessions=open_session_store(state.sessions, fleet=state.settings.fleet))


def banner(state: AppState) -> str:
    """What `loraserve serve` prints before serving: where, which keys, one curl call."""
    settings = state.settings
    base_url = f"http://{settings.host}:{settings.port}"
    lines = [f"loraserve: serving model '{state.model_name}' at {base_url}/v1"]
    if state.admin_key_created or state.demo is not None:
        lines.append(f"  admin key:       {state.admin_key}   (admin API: {base_url}/admin/api)")
    elif settings.fleet:
        lines.append("  admin key:       provided by the deploy (LORASERVE_ADMIN_KEY, the fleet's)")
    else:
        lines.append(
            f"  admin key:       kept in {settings.data_dir / ADMIN_KEY_FILE} (or LORASERVE_ADMIN_KEY)"
        )
    if state.demo is not None and settings.is_random_demo:
        body = {
            "model": state.demo.adapter_names[0],
            "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 32,
        }
        lines += [
            f"  demo tenant key: {state.demo.api_key}",
            f"  demo adapters:   {', '.join(state.demo.adapter_names)} "
            f"(or model '{state.model_name}' for the base model)",
            "",
            "  Try it:",
            _curl(base_url, state.demo.api_key, body),
            "",
            "  NOTE: this is the random demo model: its weights are RANDOM, so its answers are gibberish.",
            "  Serve the default model (SmolLM2-135M-Instruct) by leaving out --model, Gemma 3 270M with",
            "  --model gemma3-270m, or a Hugging Face checkpoint or a .gguf file of a family in",
            "  base_engine/model/README.md with:",
            "      loraserve serve --model /path/to/checkpoint-or-file.gguf",
        ]
    elif state.demo is not None:
        body = {
            "model": state.demo.adapter_names[1] if len(state.demo.adapter_names) > 1 else state.model_name,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 64,
        }
        adapters = ", ".join(
            f"{n} ({TRAITS[n].description})" for n in state.demo.adapter_names if n in TRAITS
        )
        lines += [
            f"  demo tenant key: {state.demo.api_key}",
            f"  demo adapters:   {adapters}",
            f"                   (or model '{state.model_name}' for the base model)",
            "",
            '  Try it (change "model" to another adapter or to the base model):',
            _curl(base_url, state.demo.api_key, body),
        ]
    return "\n".join(lines)


def _curl(base_url: str, api_key: str, body: dict[str, object]) -> str:
    return (
        f"  curl {base_url}/v1/chat/completions -H 'Authorization: Bearer {api_key}' "
        f"-H 'Content-Type: application/json' -d {shlex.quote(json.dumps(body))}"
    )
