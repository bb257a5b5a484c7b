"""`loraserve` command line: serve, db upgrade, tenant create, adapter push.

Options override `LORASERVE_*` environment variables (api/settings.py); management commands work
on the database and object store directly (no server needed), applying migrations first.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from api.settings import Settings, load_settings

app = typer.Typer(help="Multi-tenant LoRA serving platform.", no_args_is_help=True, add_completion=False)
db_app = typer.Typer(help="Database commands.", no_args_is_help=True)
tenant_app = typer.Typer(help="Tenant commands.", no_args_is_help=True)
adapter_app = typer.Typer(help="Adapter commands.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(tenant_app, name="tenant")
app.add_typer(adapter_app, name="adapter")

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
    host: Annotated[str | None, typer.Option(help="[default: 127.0.0.1]")] = None,
    port: Annotated[int | None, typer.Option(help="[default: 8000]")] = None,
    served_model_name: Annotated[str | None, typer.Option()] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda [default: cpu]")] = None,
    dtype: Annotated[str | None, typer.Option(help="auto | float32 | bfloat16 | float16")] = None,
    max_model_len: Annotated[int | None, typer.Option()] = None,
    max_num_seqs: Annotated[int | None, typer.Option()] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option()] = None,
    num_kv_blocks: Annotated[int | None, typer.Option()] = None,
    max_loras: Annotated[int | None, typer.Option()] = None,
    max_cpu_loras: Annotated[int | None, typer.Option()] = None,
    max_lora_rank: Annotated[int | None, typer.Option()] = None,
    max_queue_len: Annotated[int | None, typer.Option(help="waiting engine requests before 503")] = None,
    request_timeout_s: Annotated[float | None, typer.Option()] = None,
    drain_timeout_s: Annotated[float | None, typer.Option(help="SIGTERM grace period")] = None,
    max_upload_bytes: Annotated[int | None, typer.Option()] = None,
    log_level: Annotated[str | None, typer.Option()] = None,
) -> None:
    """Serve the OpenAI-compatible API, adapter uploads and the admin API."""
    options = dict(locals())
    settings = load_settings(**options)
    _setup_logging(settings.log_level)
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
    state = build_state(settings)
    typer.echo(banner(state))
    run(create_app(state), state)


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
    tenant: Annotated[str, typer.Option(help="tenant name")],
    name: Annotated[str, typer.Option(help="adapter name")],
    model: ModelOpt = None,
    db: DbOpt = None,
    data_dir: DataDirOpt = None,
    registry: RegistryOpt = None,
) -> None:
    """Validate an adapter against the base model and register it as the tenant's next version."""
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
    validate = functools.partial(
        validate_adapter,
        base=load_model_config(settings.model_dir()).base_shapes(),
        max_lora_rank=settings.max_lora_rank,
        max_size_bytes=settings.max_upload_bytes,
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


def main() -> None:
    app()
