"""`loraserve serve --replicas N` (N > 1, or `--ray`): a local Ray cluster running the fleet app.

This is one deploy: the launcher checks the fleet's requirements (api/fleet/start.py: PostgreSQL, S3, a
provided `LORASERVE_ADMIN_KEY`), applies migrations once (replicas never migrate), makes the model
once in the shared data dir, then starts Ray with this machine's CPUs, deploys
`api.fleet.ray_app:build_app` on --host/--port and waits for SIGINT/SIGTERM. On a real
cluster the same application is deployed with `serve deploy deploy/ray-serve.yaml`.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
from pathlib import Path
from typing import Any

from api.settings import Settings

logger = logging.getLogger(__name__)

APP_NAME = "loraserve"


def fleet_problems(settings: Settings) -> list[str]:
    """What keeps `settings` from deploying a fleet (api/fleet/start.py's rules), each with its fix."""
    from api.fleet.start import fleet_problems as replica_problems

    return replica_problems(settings.model_copy(update={"fleet": True}))


def prepare_deploy(settings: Settings) -> dict[str, Any]:
    """Once per deploy: migrations and the model. Returns the replicas' settings as Ray args (secrets
    stay in the environment Ray's workers inherit: `LORASERVE_ADMIN_KEY`, never in args)."""
    from api.bootstrap import resolve_model
    from api.tenancy.keyfiles import make_private_dir
    from migrations.api import upgrade

    data_dir = make_private_dir(settings.data_dir.resolve())
    upgrade(settings.db_url)
    model_dir = Path(resolve_model(settings)).resolve()
    args = settings.model_dump(exclude_unset=True, exclude={"admin_key", "metrics_token"})
    args.update(data_dir=str(data_dir), model=str(model_dir), served_model_name=settings.model_name)
    return {k: str(v) if isinstance(v, Path) else v for k, v in args.items()}


def run_local(settings: Settings, *, num_replicas: int) -> None:
    """Deploy ingress + `num_replicas` replicas on a local Ray and serve until a signal."""
    import ray
    from ray import serve

    from api.fleet.proxy_headers import proxy_env
    from api.fleet.ray_app import build_app

    if not logging.getLogger().handlers:  # a spawned child (run_supervised) starts unconfigured
        logging.basicConfig(
            level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    args = prepare_deploy(settings)
    num_cpus = os.cpu_count() or 1
    os.environ.update(proxy_env())  # the local Ray's proxy inherits it: one X-Request-Id per response
    ray.init(num_cpus=num_cpus, include_dashboard=False, configure_logging=False)
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        replica_cpus = min(1.0, num_cpus / num_replicas)
        app = build_app({**args, "num_replicas": num_replicas, "replica_num_cpus": replica_cpus})
        serve.run(app, name=APP_NAME, route_prefix="/")
        logger.info("fleet of %d replicas at http://%s:%d/v1", num_replicas, settings.host, settings.port)
        _wait_for_signal()
    except KeyboardInterrupt:  # SIGINT before _wait_for_signal: serve.run may still be waiting for the
        logger.info("stopping before the fleet was fully up")  # app to be RUNNING while it serves
    finally:
        serve.shutdown()  # replicas flush usage and stop their engines (LoraReplica.__del__)
        ray.shutdown()


def _wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


def run_supervised(settings: Settings, *, num_replicas: int) -> int:
    """`run_local` in a child process; this one turns SIGTERM into the child's SIGINT and returns its
    exit code. Ray's driver must never see a SIGTERM itself: its failure-signal handler (absl) logs it,
    calls ours and arms a 3 s SIGALRM whose handler calls abort(), so an orderly shutdown that took
    longer (replicas flushing usage, under load) ended with SIGABRT (-6) instead of exit 0."""
    child = multiprocessing.get_context("spawn").Process(
        target=run_local, args=(settings,), kwargs={"num_replicas": num_replicas}, name="loraserve-fleet"
    )
    child.start()

    def forward(*_: object) -> None:
        if child.pid is not None and child.is_alive():
            os.kill(child.pid, signal.SIGINT)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    child.join()
    return child.exitcode if child.exitcode is not None else 1
