"""`loraserve` command line: serve, db upgrade, tenant create, adapter push; and over HTTP against a
running server (api/remote_cli.py): tenant list|delete, key create|list|revoke, adapter list|delete,
adapter push --url.

Options override `LORASERVE_*` environment variables (api/settings.py); `serve`, `db upgrade`, `tenant
create` and `adapter push` without `--url` work on the database and object store directly (no server
needed), applying migrations first. Help texts are plain text (no Rich markup), so every
"[default: ...]" shows.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated

import typer

from api import remote_cli
from api.settings import Settings, load_settings

_PLAIN = {"no_args_is_help": True, "rich_markup_mode": None}  # Rich markup would eat "[default: ...]"
app = typer.Typer(help="Multi-tenant LoRA serving platform.", add_completion=False, **_PLAIN)
db_app = typer.Typer(help="Database commands.", **_PLAIN)
tenant_app = typer.Typer(help="Tenant commands.", **_PLAIN)
key_app = typer.Typer(help="API key commands (over HTTP, admin key).", **_PLAIN)
adapter_app = typer.Typer(help="Adapter commands.", **_PLAIN)
app.add_typer(db_app, name="db")
app.add_typer(tenant_app, name="tenant")
app.add_typer(key_app, name="key")
app.add_typer(adapter_app, name="adapter")


def _default(name: str, when_none: str = "set by the server") -> str:
    """The help suffix "[default: X]" of the Settings field `name` (options default to None: settings)."""
    value = Settings.model_fields[name].default
    return f"[default: {when_none if value is None else value}]"


ModelOpt = Annotated[
    Path | None,
    typer.Option(
        help="HF checkpoint directory, .gguf file (converted once, cached by hash), 'smollm2' or "
        "'random-demo' (tests) [default: SmolLM2-135M-Instruct, fetched and converted once]"
    ),
]
DataDirOpt = Annotated[Path | None, typer.Option(help="data directory [default: ./loraserve-data]")]
DbOpt = Annotated[str | None, typer.Option(help="SQLAlchemy URL [default: SQLite in the data dir]")]
RegistryOpt = Annotated[
    str | None, typer.Option(help="file:///dir or s3://bucket/prefix [default: data dir]")
]


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@app.command()
def serve(
    model: ModelOpt = None,
    data_dir: DataDirOpt = None,
    db: DbOpt = None,
    registry: RegistryOpt = None,
    host: Annotated[str | None, typer.Option(help=f"address to bind {_default('host')}")] = None,
    port: Annotated[int | None, typer.Option(help=f"port to listen on {_default('port')}")] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="name clients send as `model` [default: the model directory's name]")
    ] = None,
    device: Annotated[str | None, typer.Option(help=f"cpu | cuda {_default('device')}")] = None,
    dtype: Annotated[
        str | None, typer.Option(help=f"auto | float32 | bfloat16 | float16 {_default('dtype')}")
    ] = None,
    max_model_len: Annotated[
        int | None, typer.Option(help="longest prompt + completion in tokens [default: the model's]")
    ] = None,
    max_num_seqs: Annotated[
        int | None, typer.Option(help=f"requests decoded together {_default('max_num_seqs')}")
    ] = None,
    max_num_batched_tokens: Annotated[
        int | None, typer.Option(help=f"tokens per engine step {_default('max_num_batched_tokens')}")
    ] = None,
    num_kv_blocks: Annotated[
        int | None, typer.Option(help="KV cache blocks [default: sized from the memory budget]")
    ] = None,
    max_loras: Annotated[
        int | None, typer.Option(help=f"adapters resident on the device {_default('max_loras')}")
    ] = None,
    max_cpu_loras: Annotated[
        int | None, typer.Option(help=f"adapters kept in host memory {_default('max_cpu_loras')}")
    ] = None,
    max_lora_rank: Annotated[
        int | None, typer.Option(help=f"largest adapter rank accepted {_default('max_lora_rank')}")
    ] = None,
    max_queue_len: Annotated[
        int | None, typer.Option(help=f"waiting engine requests before 503 {_default('max_queue_len')}")
    ] = None,
    request_timeout_s: Annotated[
        float | None, typer.Option(help=f"per-request deadline in seconds {_default('request_timeout_s')}")
    ] = None,
    drain_timeout_s: Annotated[
        float | None, typer.Option(help=f"SIGTERM grace period in seconds {_default('drain_timeout_s')}")
    ] = None,
    max_upload_bytes: Annotated[
        int | None,
        typer.Option(
            help="largest adapter upload body in bytes "
            + _default("max_upload_bytes", "derived from the base model")
        ),
    ] = None,
    log_level: Annotated[
        str | None, typer.Option(help=f"debug | info | warning | error {_default('log_level')}")
    ] = None,
    deterministic: Annotated[
        bool | None,
        typer.Option(
            "--deterministic",
            help="run every request batch-invariant, as `deterministic: true` asks (a request's "
            "`deterministic: false` is overruled) [default: per request]",
        ),
    ] = None,
    fleet: Annotated[
        bool | None,
        typer.Option(
            "--fleet",
            help="run as one replica of a fleet: needs a PostgreSQL db, an s3:// registry and "
            "LORASERVE_ADMIN_KEY; migrations only by `loraserve db upgrade` [default: a single process]",
        ),
    ] = None,
    replica_id: Annotated[
        str | None,
        typer.Option(
            help="this replica's name in a fleet (/admin/api/fleet, metrics) [default: <host>-<pid>]"
        ),
    ] = None,
    replicas: Annotated[
        int,
        typer.Option(
            min=1,
            show_default=False,
            help="engine replicas behind one entry point, on a local Ray Serve (more than 1 needs what a "
            "fleet needs: a PostgreSQL db, an s3:// registry, LORASERVE_ADMIN_KEY) [default: 1, no Ray]",
        ),
    ] = 1,
    ray: Annotated[
        bool,
        typer.Option(
            "--ray", help="run on Ray Serve even with one replica [default: off]", show_default=False
        ),
    ] = False,
) -> None:
    """Serve the OpenAI-compatible API, adapter uploads and the admin API."""
    options = dict(locals())
    # Issue 16 part B: --replicas N > 1 / --ray deploy the fleet on a local Ray (api/fleet/launch.py).
    num_replicas, use_ray = options.pop("replicas"), options.pop("ray")
    if num_replicas > 1 or use_ray:
        _serve_on_ray(load_settings(**options), num_replicas)
        return
    settings = load_settings(**options)
    from api.fleet_start import FleetStartError, check_fleet_settings

    try:
        check_fleet_settings(settings)  # before any model is fetched or any file written
    except FleetStartError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    _setup_logging(settings.log_level)
    from base_engine.engine import check_device

    try:
        check_device(settings.device)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--device") from None
    from api.app import create_app
    from api.bootstrap import banner, build_state
    from api.server import run

    try:
        source = settings.model_source
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--model") from None
    if source.kind == "random-demo":
        typer.echo(f"Using the random-weight demo model in {settings.demo_model_dir}")
    elif source.kind == "default":
        typer.echo(f"Serving the default model {source.served_name} (models kept in {settings.models_path})")
    os.umask(0o077)  # whatever the server writes is private to its user (api/keyfiles.py)
    try:
        state = build_state(settings)
    except FleetStartError as exc:  # e.g. the shared database is not migrated
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(banner(state))
    run(create_app(state), state)


def _serve_on_ray(settings: Settings, num_replicas: int) -> None:
    from api.fleet.launch import fleet_problems, run_supervised

    _setup_logging(settings.log_level)
    problems = fleet_problems(settings)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        typer.echo(f"error: --replicas {num_replicas} runs a fleet, which needs:\n{lines}", err=True)
        raise typer.Exit(2)
    os.umask(0o077)
    code = run_supervised(settings, num_replicas=num_replicas)
    if code:
        raise typer.Exit(code if code > 0 else 1)


@db_app.command("upgrade")
def db_upgrade(db: DbOpt = None, data_dir: DataDirOpt = None) -> None:
    """Apply pending migrations to the database."""
    from registry.db import upgrade

    settings = load_settings(db=db, data_dir=data_dir)
    _setup_logging(settings.log_level)
    upgrade(settings.db_url)
    typer.echo(f"database at head: {settings.db_url}")


def _sessions(settings: Settings):  # noqa: ANN202 - a sessionmaker
    from registry.db import make_engine, session_factory, upgrade

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.db_url)
    return session_factory(make_engine(settings.db_url))


@tenant_app.command("create")
def tenant_create(name: str, db: DbOpt = None, data_dir: DataDirOpt = None) -> None:
    """Create a tenant and print its first API key (shown once)."""
    from registry.errors import RegistryError
    from registry.tenants import create_tenant

    settings = load_settings(db=db, data_dir=data_dir)
    with _sessions(settings)() as session:
        try:
            info, api_key = create_tenant(session, name=name)
        except RegistryError as exc:
            raise typer.BadParameter(str(exc), param_hint="NAME") from None
    typer.echo(f"tenant {info.name} ({info.id})")
    typer.echo(api_key)


@adapter_app.command("push")
def adapter_push(
    directory: Annotated[Path, typer.Argument(help="PEFT adapter directory", exists=True, file_okay=False)],
    name: Annotated[str, typer.Option(help="adapter name")],
    url: Annotated[
        str | None,
        typer.Option(envvar="LORASERVE_URL", help="upload to this running server (key: LORASERVE_API_KEY)"),
    ] = None,
    api_key: remote_cli.ApiKeyOpt = None,
    timeout_s: Annotated[float, typer.Option(help="seconds to wait for the upload's answer")] = 600.0,
    tenant: Annotated[str | None, typer.Option(help="tenant name (without --url: required)")] = None,
    model: ModelOpt = None,
    db: DbOpt = None,
    data_dir: DataDirOpt = None,
    registry: RegistryOpt = None,
) -> None:
    """Register an adapter as the next version of NAME: with --url, uploaded to a running server (with a
    progress bar; the tenant is the key's); without, validated here against --model and written to the
    database and object store directly."""
    if url is not None:
        remote_cli.push_over_http(directory, name, url, api_key, timeout_s)
        return
    if tenant is None:
        raise typer.BadParameter("--tenant is required without --url", param_hint="--tenant")
    import functools

    from adapters.validation import validate_adapter
    from api.model_source import last_served_model
    from base_engine.config import load_model_config
    from base_engine.engine import DTYPES
    from registry.adapters import register_adapter_version
    from registry.errors import RegistryError
    from registry.store import open_store
    from registry.tenants import get_tenant_by_name

    settings = load_settings(model=model, db=db, data_dir=data_dir, registry=registry)
    if settings.model is None and (served := last_served_model(settings.data_dir)) is not None:
        settings = settings.model_copy(update={"model": Path(served)})  # what `serve` loads here
    from api.uploads import upload_limits

    base = load_model_config(settings.model_dir()).base_shapes()
    validate = functools.partial(
        validate_adapter,
        base=base,
        max_lora_rank=settings.max_lora_rank,
        max_size_bytes=upload_limits(settings, base).weights_bytes,
        dtype=DTYPES.get(settings.dtype, DTYPES["float32"]),
    )
    with _sessions(settings)() as session:
        try:
            owner = get_tenant_by_name(session, name=tenant)
            info = register_adapter_version(
                session,
                open_store(settings.registry_url),
                tenant_id=owner.id,
                name=name,
                files_dir=directory,
                validate=validate,
                base_model=settings.model_name,
            )
        except RegistryError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
    modules = ",".join(info.modules)
    typer.echo(f"{info.name}@{info.version} sha256={info.sha256} rank={info.max_rank} modules={modules}")


remote_cli.register(tenant_app, key_app, adapter_app)


def main() -> None:
    app()
