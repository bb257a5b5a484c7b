"""`loraserve` command line: serve, db upgrade, tenant create, adapter push, adapter convert (pickle
weights to safetensors, locally: api/cli/convert.py); and over HTTP against a
running server (api/cli/remote.py): tenant list|delete, key create|list|revoke, adapter list|delete,
adapter push --url.

Options override `LORASERVE_*` environment variables (api/settings.py); `serve`, `db upgrade`, `tenant
create` and `adapter push` without `--url` work on the database and object store directly (no server
needed), applying migrations first. Help texts are plain text (no Rich markup), so every
"[default: ...]" shows.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from api.cli import remote as remote_cli
from api.cli.options import DataDirOpt, DbOpt, ModelOpt, RegistryOpt, setup_logging
from api.cli.serve import serve
from api.cli.vllm_flags import VllmFlagError, rewrite_vllm_argv
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
app.command()(serve)  # api/cli/serve.py


@db_app.command("upgrade")
def db_upgrade(db: DbOpt = None, data_dir: DataDirOpt = None) -> None:
    """Apply pending migrations to the database."""
    from migrations.api import upgrade

    settings = load_settings(db=db, data_dir=data_dir)
    setup_logging(settings.log_level)
    upgrade(settings.db_url)
    typer.echo(f"database at head: {settings.db_url}")


def _sessions(settings: Settings):  # noqa: ANN202 - a sessionmaker
    from migrations.api import upgrade
    from registry.db import make_engine, session_factory

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
    from api.checkpoints.sources import last_served_model
    from base_engine.model.config import load_model_config
    from base_engine.runner.device import DTYPES
    from registry.adapters import register_adapter_version
    from registry.errors import RegistryError
    from registry.stores import open_store
    from registry.tenants import get_tenant_by_name

    settings = load_settings(model=model, db=db, data_dir=data_dir, registry=registry)
    if settings.model is None and (served := last_served_model(settings.data_dir)) is not None:
        settings = settings.model_copy(update={"model": Path(served)})  # what `serve` loads here
    from api.bootstrap import resolve_model
    from api.tenant_adapters.uploads import upload_limits

    base = load_model_config(resolve_model(settings)).base_shapes()
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


@adapter_app.command("convert")
def adapter_convert(
    directory: Annotated[Path, typer.Argument(help="PEFT adapter directory", exists=True, file_okay=False)],
    force: Annotated[bool, typer.Option(help="replace an existing adapter_model.safetensors")] = False,
) -> None:
    """Convert DIRECTORY's pickle weights (adapter_model.bin) to adapter_model.safetensors, here: read with
    torch.load(weights_only=True), which runs no code from the pickle. The server never reads .bin."""
    from api.cli.convert import convert_pickle_weights

    try:
        target = convert_pickle_weights(directory, overwrite=force)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"wrote {target}; upload the directory with `loraserve adapter push`")


remote_cli.register(tenant_app, key_app, adapter_app)


def main() -> None:
    # libgomp (torch's OpenMP) reads its wait policy once, when torch loads it; nothing here has imported
    # torch yet. PASSIVE: a thread that finishes its share of a parallel region sleeps at the join
    # instead of spinning (libgomp's default spins ~300k iterations first). On cores shared with other
    # work, or under a CPU quota, the spinners take the time slice the one descheduled straggler needs, and
    # each of a step's many small regions waits on it. A user's own OMP_WAIT_POLICY wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if sys.argv[1:2] == ["--version"] or (sys.argv[1:2] == ["serve"] and "--version" in sys.argv):
        typer.echo(f"loraserve {importlib.metadata.version('loraserve')}")  # as `vllm --version`
        return
    try:
        sys.argv[1:] = rewrite_vllm_argv(sys.argv[1:])  # `vllm serve MODEL --lora-modules ...`
    except VllmFlagError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise SystemExit(2) from None
    app()
