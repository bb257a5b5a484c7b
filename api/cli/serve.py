"""`loraserve serve`: its options (each overrides a `LORASERVE_*` setting, api/settings.py) and the
start-up: fleet checks, device check, model source, state, and the server; or, with `--replicas N`
/ `--ray`, the fleet on a local Ray Serve (api/fleet/launch.py).

Separate from api/cli/main.py (the command groups and the commands that work on the database directly)
because `serve` alone has some thirty options.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer

from api.cli.options import (
    DataDirOpt,
    DbOpt,
    MaxChoicesOpt,
    MaxLogprobEntriesOpt,
    MaxStopStringCharsOpt,
    MaxStopStringsOpt,
    MaxStopTokenIdsOpt,
    ModelOpt,
    RegistryOpt,
    setup_logging,
)
from api.cli.options import settings_default as _default
from api.settings import Settings, load_settings


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
    quantization: Annotated[
        str | None,
        typer.Option(help="int8: per-channel int8 base weights computed at load, CPU [default: none]"),
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
    kv_cache_gb: Annotated[
        float | None, typer.Option(help="KV cache size in GiB [default: a fraction of the free memory]")
    ] = None,
    kv_cache_memory_fraction: Annotated[
        float | None,
        typer.Option(help="share of the free memory the KV cache takes [default: 0.3 on CPU, 0.9 on CUDA]"),
    ] = None,
    num_threads: Annotated[
        int | None,
        typer.Option(help="CPU intra-op threads [default: the CPUs this process may use: affinity, quota]"),
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
    max_choices_per_request: MaxChoicesOpt = None,
    max_logprob_entries_per_response: MaxLogprobEntriesOpt = None,
    max_stop_strings: MaxStopStringsOpt = None,
    max_stop_string_chars: MaxStopStringCharsOpt = None,
    max_stop_token_ids: MaxStopTokenIdsOpt = None,
    max_upload_bytes: Annotated[
        int | None,
        typer.Option(
            help="largest adapter upload body in bytes "
            + _default("max_upload_bytes", "derived from the base model")
        ),
    ] = None,
    max_request_body_bytes: Annotated[
        int | None,
        typer.Option(
            help="largest request body in bytes, uploads aside (larger: 413 before it is read) "
            + _default("max_request_body_bytes")
        ),
    ] = None,
    request_body_timeout_s: Annotated[
        float | None,
        typer.Option(
            help=f"seconds a request body may take to arrive, else 408 {_default('request_body_timeout_s')}"
        ),
    ] = None,
    request_header_timeout_s: Annotated[
        float | None,
        typer.Option(
            help="seconds a connection may take to send a request's headers (slow: 408 and closed) "
            + _default("request_header_timeout_s")
        ),
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option(help=f"seeds the engine and the seeds drawn for unseeded requests {_default('seed')}"),
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
    speculative: Annotated[
        str | None,
        typer.Option(
            help="speculative decoding: ngram (prompt lookup; the same tokens, fewer steps) [default: off]"
        ),
    ] = None,
    num_speculative_tokens: Annotated[
        int | None,
        typer.Option(help=f"most draft tokens per request and step {_default('num_speculative_tokens')}"),
    ] = None,
    speculative_off_batch: Annotated[
        int | None,
        typer.Option(
            help="no drafts in a step with this many decoding requests (0: never), adaptive k "
            "alone [default: measured at start, with the verify cost per batch and k that "
            "cost-aware k weighs]"
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
    lora_modules: Annotated[
        list[str] | None,
        typer.Option(
            "--lora-module",
            help="name=path: a PEFT adapter registered at start for --tenant (vLLM's `--lora-modules a=DIR "
            "b=DIR` is accepted too) [default: none]",
        ),
    ] = None,
    static_api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            help="vLLM's --api-key: a static key that acts as a key of --tenant (single-tenant use) "
            "[default: only issued keys]",
        ),
    ] = None,
    static_tenant: Annotated[
        str | None,
        typer.Option("--tenant", help="the tenant of --lora-module and --api-key [default: demo]"),
    ] = None,
    chat_template: Annotated[
        str | None,
        typer.Option(help="a Jinja chat template, or a file holding one [default: the checkpoint's]"),
    ] = None,
    tool_call_parser: Annotated[
        str | None,
        typer.Option(help="tool-call syntax: hermes | mistral | llama3_json [default: from the template]"),
    ] = None,
    ray: Annotated[
        bool,
        typer.Option(
            "--ray", help="run on Ray Serve even with one replica [default: off]", show_default=False
        ),
    ] = False,
) -> None:
    """Serve the OpenAI-compatible API, adapter uploads and the admin API."""
    options = dict(locals())
    # --replicas N > 1 / --ray deploy the fleet on a local Ray (api/fleet/launch.py).
    num_replicas, use_ray = options.pop("replicas"), options.pop("ray")
    if num_replicas > 1 or use_ray:
        _serve_on_ray(load_settings(**options), num_replicas)
        return
    settings = load_settings(**options)
    from api.fleet.start import FleetStartError, check_fleet_settings

    try:
        check_fleet_settings(settings)  # before any model is fetched or any file written
    except FleetStartError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    setup_logging(settings.log_level)
    from base_engine.runner.device import check_device

    try:
        check_device(settings.device)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--device") from None
    from base_engine.speculative.speculator import parse_speculative

    try:
        parse_speculative(settings.speculative)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--speculative") from None
    from api.app import run_server
    from api.bootstrap import StartError, banner, build_state

    try:
        source = settings.model_source
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--model") from None
    if source.kind == "random-demo":
        typer.echo(f"Using the random-weight demo model in {settings.demo_model_dir}")
    elif source.kind == "default":
        typer.echo(f"Serving the default model {source.served_name} (models kept in {settings.models_path})")
    elif source.kind == "packaged":
        typer.echo(f"Serving {source.served_name} (models kept in {settings.models_path})")
    os.umask(0o077)  # whatever the server writes is private to its user (api/tenancy/keyfiles.py)
    try:
        state = build_state(settings)
    except (FleetStartError, StartError) as exc:  # e.g. an unsupported checkpoint: one line, no traceback
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(banner(state))
    run_server(state)


def _serve_on_ray(settings: Settings, num_replicas: int) -> None:
    from api.fleet.launch import fleet_problems, run_supervised

    setup_logging(settings.log_level)
    problems = fleet_problems(settings)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        typer.echo(f"error: --replicas {num_replicas} runs a fleet, which needs:\n{lines}", err=True)
        raise typer.Exit(2)
    os.umask(0o077)
    code = run_supervised(settings, num_replicas=num_replicas)
    if code:
        raise typer.Exit(code if code > 0 else 1)
