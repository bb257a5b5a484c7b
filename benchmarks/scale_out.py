"""Scale-out on Ray Serve: 2 replicas vs 1 on the lora workload, and adapter loads per
request with affinity routing vs without (random: Ray's least-loaded choice, no model id).

    python benchmarks/scale_out.py            # one JSON line; about 4 minutes on 2 CPU cores

One local Ray cluster (this machine's CPUs), a throwaway PostgreSQL + moto S3, the small random model
of benchmarks/serving.py and `--num-adapters` random adapters; each phase deploys the fleet app
(api/fleet/ray_app.py) anew and drives it with serving.py's load generator (streaming chat, Zipf
adapter popularity, Poisson arrivals at `--rate`). Adapter loads are each replica's own engine
counter (`/admin/api/engine`, asked until every replica answered), before and after the load.
With 2 replicas of `--max-loras` slots each and more adapters than one replica holds, affinity keeps
each adapter on the replica that has it; random routing makes every replica cycle through all of
them. On a shared 2-core machine the throughput ratio is bounded by the cores, not by the design.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serving import SMALL_MODEL, run_load  # noqa: E402
from tests.harness.postgres import NoPostgres, new_database, postgres_cluster  # noqa: E402
from tests.harness.s3 import s3_backend  # noqa: E402
from tests.harness.servers import free_port_for_ray  # noqa: E402

ADMIN_KEY = f"lsa-{uuid.uuid4().hex}"


def throwaway_postgres(stack: ExitStack) -> str:
    """A throwaway PostgreSQL cluster (stopped by `stack`); its admin URL."""
    try:
        return stack.enter_context(postgres_cluster())
    except NoPostgres as missing:
        raise SystemExit(str(missing)) from None


def adapter_loads(base_url: str, num_replicas: int) -> dict[str, int]:
    """replica id -> its engine's adapter loads so far (any replica answers: ask until all did)."""
    seen: dict[str, int] = {}
    deadline = time.monotonic() + 120
    while len(seen) < num_replicas and time.monotonic() < deadline:
        r = httpx.get(
            f"{base_url}/admin/api/engine", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
        )
        r.raise_for_status()
        seen[r.headers["x-loraserve-replica"]] = int(r.json()["adapters"]["loads"])
    if len(seen) < num_replicas:
        raise RuntimeError(f"only {len(seen)} of {num_replicas} replicas answered /admin/api/engine")
    return seen


def upload_adapters(base_url: str, model_dir: Path, tmp: Path, num: int) -> tuple[str, list[str]]:
    from adapters.testing import save_random_adapter
    from base_engine.model.config import load_model_config

    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    r = httpx.post(f"{base_url}/admin/api/tenants", headers=admin, json={"name": "bench"}, timeout=60)
    r.raise_for_status()
    api_key = r.json()["api_key"]
    shapes = load_model_config(model_dir).base_shapes()
    names = []
    for i in range(num):
        adapter = save_random_adapter(tmp / f"adapter{i}", shapes, rank=8, alpha=16, seed=i)
        files = [("files", (p.name, p.read_bytes())) for p in sorted(adapter.iterdir())]
        r = httpx.post(
            f"{base_url}/v1/adapters",
            headers={"Authorization": f"Bearer {api_key}"},
            data={"name": f"adapter{i}"},
            files=files,
            timeout=120,
        )
        r.raise_for_status()
        names.append(f"adapter{i}")
    return api_key, names


def phase(
    args: argparse.Namespace, deploy_args: dict[str, Any], base_url: str, *, num_replicas: int, affinity: bool
) -> dict[str, Any]:
    """Deploy the fleet with `num_replicas` replicas, warm it, run the load; its figures."""
    from ray import serve

    from api.fleet.ray_app import build_app

    app = build_app({**deploy_args, "num_replicas": num_replicas, "affinity": affinity})
    serve.run(app, name="loraserve", route_prefix="/")
    key, models = args.key, args.models
    for model in models:  # warm: each adapter loaded somewhere once, as in steady state
        warm = httpx.post(
            f"{base_url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            timeout=300,
        )
        warm.raise_for_status()
    time.sleep(2.0)  # replicas report their model ids to Ray's routers through the controller
    before = adapter_loads(base_url, num_replicas)
    report = asyncio.run(run_load(args, base_url, key, models))
    after = adapter_loads(base_url, num_replicas)
    loads = sum(after[r] - before.get(r, 0) for r in after)
    serve.delete("loraserve")
    return {
        "num_replicas": num_replicas,
        "affinity": affinity,
        "num_ok": report["num_ok"],
        "errors": report["errors"],
        "output_tok_s": report["output_tok_s"],
        "request_rps": report["request_rps"],
        "e2e_p50_s": report["e2e_s"]["p50"],
        "adapter_loads": loads,
        "loads_per_request": loads / max(1, report["num_requests"]),
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-adapters", type=int, default=6)
    p.add_argument("--max-loras", type=int, default=3, help="adapter slots per replica (Ray's LRU size)")
    # One more host copy than slots: a replica keeps the adapter it just evicted from a slot in memory.
    p.add_argument("--max-cpu-loras", type=int, default=4, help="host-tier adapters per replica")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=16.0, help="Poisson arrival rate, requests/s")
    p.add_argument("--zipf-s", type=float, default=0.5, help="Zipf exponent of adapter popularity")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--prompt-words", type=int, nargs=2, default=(8, 32))
    p.add_argument("--slo-ttft-s", type=float, default=2.0)
    p.add_argument("--slo-itl-s", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    config = dict(vars(args))
    import ray
    from ray import serve

    from api.fleet.launch import prepare_deploy
    from api.settings import load_settings
    from base_engine.testing.checkpoint import save_random_checkpoint

    with ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="loraserve-scale-"))
        stack.callback(shutil.rmtree, tmp, True)
        from moto.server import ThreadedMotoServer

        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        moto.start()
        stack.callback(moto.stop)
        host, port = moto.get_host_and_port()
        s3 = s3_backend(f"http://{host}:{port}", tmp)
        db_url = new_database(throwaway_postgres(stack))
        model_dir = save_random_checkpoint(tmp / "model", **SMALL_MODEL)  # type: ignore[arg-type]
        settings = load_settings(
            model=model_dir, served_model_name="bench", data_dir=tmp / "data", db=db_url,
            registry=f"s3://{s3['bucket']}/registry", num_kv_blocks=1024, max_num_seqs=32,
            max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras, log_level="warning",
        )  # fmt: skip
        deploy_args = prepare_deploy(settings)
        env = {k: v for k, v in s3.items() if k.startswith("AWS_")} | {"LORASERVE_ADMIN_KEY": ADMIN_KEY}
        ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, runtime_env={"env_vars": env},
                 log_to_driver=False)  # fmt: skip
        stack.callback(ray.shutdown)
        http_port = free_port_for_ray()
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        stack.callback(serve.shutdown)
        base_url = f"http://127.0.0.1:{http_port}"
        serve.run(build_first(deploy_args), name="loraserve", route_prefix="/")
        args.key, args.models = upload_adapters(base_url, model_dir, tmp, args.num_adapters)
        serve.delete("loraserve")
        two = phase(args, deploy_args, base_url, num_replicas=2, affinity=True)
        two_random = phase(args, deploy_args, base_url, num_replicas=2, affinity=False)
        one = phase(args, deploy_args, base_url, num_replicas=1, affinity=True)
    line = {
        "benchmark": "scale_out",
        "config": config,
        "cpus": os.cpu_count(),
        "throughput_ratio_2_vs_1": two["output_tok_s"] / one["output_tok_s"] if one["output_tok_s"] else None,
        "loads_per_request_affinity": two["loads_per_request"],
        "loads_per_request_random": two_random["loads_per_request"],
        "phases": [two, two_random, one],
    }
    print(json.dumps(line))


def build_first(deploy_args: dict[str, Any]) -> Any:
    """One replica only to upload the adapters (uploads go to the shared registry, not a replica)."""
    from api.fleet.ray_app import build_app

    return build_app({**deploy_args, "num_replicas": 1})


if __name__ == "__main__":
    main()
