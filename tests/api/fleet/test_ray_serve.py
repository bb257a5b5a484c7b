"""The fleet on a real local Ray Serve: ingress + 2 engine replicas on CPU.

One Ray cluster per module (num_cpus=2; each replica one CPU and one engine thread) serving the tiny
random Llama on a throwaway PostgreSQL + moto S3, deployed as `loraserve serve --replicas 2` deploys
it (api/fleet/launch.py `prepare_deploy`, api/fleet/ray_app.py `build_app`). Requests go over HTTP to
Ray's proxy. Affinity is measured by each replica itself (`x-loraserve-adapter-resident`: the adapter
was in that engine on arrival) and by the engines' own adapter-load counters, not by the router.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text

from tests.harness.postgres import new_database
from tests.harness.s3 import s3_backend
from tests.harness.servers import ServerProcess, free_port_for_ray
from tests.harness.uploads import files_of, peft_adapter
from tests.harness.wait import wait_for

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(600)]

ADMIN_KEY = "lsa-fleet-test-admin-key"
MODEL = "tiny-llama"


def _ready_replicas(fleet: Fleet, *, want: int, timeout_s: float = 60.0) -> set[str]:
    """Ids of the replicas /admin/api/fleet shows ready, once there are `want` of them."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = fleet.admin("GET", "/fleet")
        assert r.status_code == 200, r.text
        ready = {row["id"] for row in r.json()["data"] if row["state"] == "ready"}
        if len(ready) >= want or time.monotonic() > deadline:
            assert len(ready) == want, r.json()
            return ready
        time.sleep(0.5)


@dataclass
class Fleet:
    base_url: str
    db_url: str

    def admin(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        return httpx.request(
            method, f"{self.base_url}/admin/api{path}", headers=headers, timeout=60, **kwargs
        )

    def tenant(self) -> tuple[str, str]:
        r = self.admin("POST", "/tenants", json={"name": f"t-{uuid.uuid4().hex[:8]}"})
        assert r.status_code == 201, r.text
        return r.json()["id"], r.json()["api_key"]

    def upload(self, key: str, name: str, directory: Path) -> None:
        parts = [("files", (f, c, "application/octet-stream")) for f, c in files_of(directory).items()]
        r = httpx.post(
            f"{self.base_url}/v1/adapters",
            headers={"Authorization": f"Bearer {key}"},
            data={"name": name},
            files=parts,
            timeout=120,
        )
        assert r.status_code == 201, r.text

    def complete(self, key: str, model: str, *, stream: bool = False, max_tokens: int = 4) -> httpx.Response:
        body = {"model": model, "prompt": "hello fleet", "max_tokens": max_tokens, "stream": stream}
        return httpx.post(
            f"{self.base_url}/v1/completions",
            headers={"Authorization": f"Bearer {key}"},
            json=body,
            timeout=120,
        )

    def usage_ids(self, tenant_id: str) -> list[str]:
        engine = create_engine(self.db_url)
        try:
            with engine.connect() as conn:
                rows = conn.execute(
                    text("SELECT request_id FROM usage_records WHERE tenant_id = :t"), {"t": tenant_id}
                )
                return [r[0] for r in rows]
        finally:
            engine.dispose()

    def usage_row(self, request_id: str) -> dict[str, Any] | None:
        engine = create_engine(self.db_url)
        try:
            with engine.connect() as conn:
                row = conn.execute(
                    text("SELECT completion_tokens, finish_reason FROM usage_records WHERE request_id = :r"),
                    {"r": request_id},
                ).one_or_none()
                return None if row is None else dict(row._mapping)
        finally:
            engine.dispose()

    def engine_stats_by_replica(self, timeout_s: float = 60.0) -> dict[str, dict[str, Any]]:
        """Each replica's own engine stats: /admin/api/engine lands on any replica, so ask until both
        answered (the replica header names which one did)."""
        seen: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(seen) < 2 and time.monotonic() < deadline:
            r = self.admin("GET", "/engine")
            assert r.status_code == 200, r.text
            seen[r.headers["x-loraserve-replica"]] = r.json()
        assert len(seen) == 2, f"only replicas {sorted(seen)} answered"
        return seen


def request_id(response: httpx.Response) -> str:
    """Our X-Request-Id, the only one (Ray's proxy appends its own unless api/fleet/proxy_headers.py
    removes it)."""
    ids = response.headers.get_list("x-request-id")
    assert len(ids) == 1, ids
    return ids[0]


def test_loraserve_serve_replicas_2_runs_the_fleet_and_stops_on_sigterm(
    tiny_llama_dir: Path, postgres_url: str, s3_server: str, tmp_path: Path
) -> None:
    """The CLI path (its own local Ray; first in this module, before the shared cluster starts)."""
    s3 = s3_backend(s3_server, tmp_path)
    env = {k: v for k, v in s3.items() if k.startswith("AWS_")} | {"LORASERVE_ADMIN_KEY": ADMIN_KEY}
    args = [
        "--replicas", "2", "--model", str(tiny_llama_dir), "--served-model-name", MODEL,
        "--db", new_database(postgres_url), "--registry", f"s3://{s3['bucket']}/registry",
        "--max-model-len", "256", "--num-kv-blocks", "128", "--max-num-seqs", "4",
    ]  # fmt: skip
    process = ServerProcess(args, tmp_path / "data", env=env, port=free_port_for_ray()).start(timeout_s=300)
    try:
        fleet = Fleet(process.base_url, "")
        _, key = fleet.tenant()  # migrations ran once, before the replicas started
        with ThreadPoolExecutor(6) as pool:  # concurrent, so Ray's router spreads them
            answers = list(pool.map(lambda _: fleet.complete(key, MODEL, max_tokens=16), range(12)))
        assert [r.status_code for r in answers] == [200] * 12, [r.text for r in answers]
        assert all(request_id(r).startswith("cmpl-") for r in answers)  # one id, ours, through Ray
        ready = _ready_replicas(fleet, want=2)  # each replica's own heartbeat: both up and serving
        assert {r.headers["x-loraserve-replica"] for r in answers} <= ready
    finally:
        code = process.stop(timeout_s=120)
    assert code == 0, process.log()[-4000:]


@pytest.fixture(scope="module")
def fleet(
    tiny_llama_dir: Path, postgres_url: str, s3_server: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    from api.fleet.launch import prepare_deploy
    from api.fleet.proxy_headers import proxy_env
    from api.fleet.ray_app import build_app
    from api.settings import load_settings

    tmp = tmp_path_factory.mktemp("ray-fleet")
    db_url = new_database(postgres_url)
    s3 = s3_backend(s3_server, tmp)
    env = {k: v for k, v in s3.items() if k.startswith("AWS_")}
    env |= {"LORASERVE_ADMIN_KEY": ADMIN_KEY, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    settings = load_settings(
        model=tiny_llama_dir, served_model_name=MODEL, data_dir=tmp / "data", db=db_url,
        registry=f"s3://{s3['bucket']}/registry", max_model_len=256, num_kv_blocks=256, max_num_seqs=8,
        max_loras=4, max_cpu_loras=8, max_lora_rank=16, usage_flush_interval_s=0.2, log_level="warning",
    )  # fmt: skip
    args = prepare_deploy(settings)  # migrations once, as `loraserve serve --replicas 2` does
    port = free_port_for_ray()
    monkeypatch = pytest.MonkeyPatch()
    for name, value in proxy_env().items():  # as `loraserve serve --replicas` sets it
        monkeypatch.setenv(name, value)
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({**args, "num_replicas": 2}), name="loraserve", route_prefix="/")
        fleet = Fleet(f"http://127.0.0.1:{port}", db_url)
        wait_for(
            lambda: httpx.get(f"{fleet.base_url}/health", timeout=5).status_code == 200,
            120,
            interval=0.2,
            what="health",
        )
        yield fleet
    finally:
        serve.shutdown()
        ray.shutdown()
        monkeypatch.undo()


@pytest.fixture(scope="module")
def adapters(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, list[str]]:
    """A tenant with four adapters: (tenant id, key, names)."""
    tenant_id, key = fleet.tenant()
    names = [f"a{i}" for i in range(4)]
    for i, name in enumerate(names):
        fleet.upload(key, name, peft_adapter(tmp_path_factory.mktemp(name), seed=i))
    return tenant_id, key, names


def test_requests_stick_to_replicas_holding_their_adapter(
    fleet: Fleet, adapters: tuple[str, str, list[str]]
) -> None:
    tenant_id, key, names = adapters
    for name in names:  # warm-up: each adapter becomes resident somewhere, Ray's router learns where
        for _ in range(2):
            assert fleet.complete(key, name).status_code == 200
    time.sleep(2.0)  # replicas report their model ids through Ray's controller
    before = fleet.engine_stats_by_replica()
    order = [name for name in names for _ in range(10)]
    random.Random(0).shuffle(order)
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda name: fleet.complete(key, name), order))
    assert [r.status_code for r in responses] == [200] * 40, [
        r.text for r in responses if r.status_code != 200
    ]
    resident = Counter(r.headers["x-loraserve-adapter-resident"] for r in responses)
    assert resident["1"] >= 36, f"only {resident['1']}/40 requests found their adapter resident"
    after = fleet.engine_stats_by_replica()
    loads = sum(after[r]["adapters"]["loads"] - before[r]["adapters"]["loads"] for r in after)
    assert loads <= 4, f"{loads} adapter loads for 40 requests over 4 warm adapters"
    # Billing: one usage record per request, ids as the responses reported them.
    ids = [request_id(r) for r in responses]
    assert ids == [r.json()["id"] for r in responses]
    billed = wait_for(lambda: (u := fleet.usage_ids(tenant_id)) and len(u) >= 48 and u, 30, what="usage")
    assert len(billed) == len(set(billed)) == 48
    assert set(ids) <= set(billed)


def test_streams_end_to_end_and_base_model_goes_anywhere(
    fleet: Fleet, adapters: tuple[str, str, list[str]]
) -> None:
    _, key, names = adapters
    r = fleet.complete(key, names[0], stream=True, max_tokens=8)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    assert json.loads(events[0][6:])["id"] == request_id(r)
    replicas = {fleet.complete(key, MODEL).headers["x-loraserve-replica"] for _ in range(12)}
    assert len(replicas) == 2, "base-model requests should spread over both replicas"


def test_client_disconnect_aborts_the_replicas_request(fleet: Fleet) -> None:
    _, key = fleet.tenant()
    body = {"model": MODEL, "prompt": "go", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=fleet.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            rid = request_id(stream)
            next(line for line in stream.iter_lines() if line.startswith("data: "))
    # The connection is gone: Ray cancels the ingress, the ingress the replica's call, the replica's
    # app sees http.disconnect and aborts the engine request, which is billed for what it produced.
    row = wait_for(lambda: fleet.usage_row(rid), 30, what="the aborted request's usage")
    assert row["completion_tokens"] < 240 and row["finish_reason"] != "length", row


def test_a_tenants_rpm_limit_holds_across_both_replicas(fleet: Fleet) -> None:
    tenant_id, key = fleet.tenant()
    assert fleet.admin("PUT", f"/tenants/{tenant_id}/quotas", json={"rpm": 10}).status_code == 200
    start = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda _: fleet.complete(key, MODEL, max_tokens=1), range(20)))
    elapsed = time.monotonic() - start
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(refused) == 20, [r.text for r in responses]
    # One bucket for the fleet (api/tenancy/quotas_db.py), not one per replica: 20 would pass with two.
    assert 10 <= len(ok) <= 10 + int(elapsed / 6), (len(ok), elapsed)  # rpm 10 refills one per 6 s
    assert all(r.headers["retry-after"] for r in refused)
    assert len({r.headers["x-loraserve-replica"] for r in responses}) == 2


def replica_actor(unique_id: str) -> Any:
    """The Ray actor of the replica whose `x-loraserve-replica` is `unique_id`."""
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith("SERVE_REPLICA::") and actor["name"].endswith(f"#{unique_id}"):
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise AssertionError(f"no replica actor {unique_id}")


def test_a_replica_killed_mid_load_fails_cleanly_and_bills_nothing_twice(
    fleet: Fleet, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tenant_id, key = fleet.tenant()
    fleet.upload(key, "k", peft_adapter(tmp_path_factory.mktemp("k"), seed=7))
    body = {"model": "k", "prompt": "count", "max_tokens": 200, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=fleet.base_url, headers=headers, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            victim = stream.headers["x-loraserve-replica"]
            # Load in flight on both replicas (base model: any replica) while the victim dies.
            with ThreadPoolExecutor(8) as pool:
                load = [pool.submit(fleet.complete, key, MODEL, max_tokens=64) for _ in range(8)]
                time.sleep(0.3)
                ray.kill(replica_actor(victim))
                rest = [line for line in lines if line.startswith("data: ")]
                in_flight = [f.result() for f in load]
    # The cut stream ends with an OpenAI-shaped error event, not a hang or a [DONE] it did not earn.
    assert json.loads(first[6:])["object"] == "text_completion"
    assert rest and rest[-1] != "data: [DONE]"
    assert json.loads(rest[-1][6:])["error"]["code"] == "replica_unavailable"
    # In-flight non-streamed requests: answered (retried on the other replica) or a clean 503.
    for r in in_flight:
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            assert r.headers["retry-after"] and r.json()["error"]["code"] == "replica_unavailable"
    # Later requests are served (by the survivor, until Ray replaces the victim).
    later = [fleet.complete(key, name) for name in ["k", MODEL] * 5]
    assert [r.status_code for r in later] == [200] * 10, [r.text for r in later]
    assert victim not in {r.headers["x-loraserve-replica"] for r in later}
    # Billing: every answered request once; nothing more than was sent (a retry keeps its id).
    answered = {request_id(r) for r in [*in_flight, *later] if r.status_code == 200}
    billed = wait_for(lambda: answered <= set(u := fleet.usage_ids(tenant_id)) and u, 30, what="usage")
    assert len(billed) == len(set(billed)) <= 1 + len(in_flight) + len(later)


def test_a_clients_request_id_is_the_fleets_own(fleet: Fleet) -> None:
    """Through the ingress as on one server (tests/api/inference/test_client_request_id.py): echoed,
    the response id and the usage record's; reused once billed, or while in flight on any replica:
    a 409; malformed: a 400."""
    tenant_id, key = fleet.tenant()
    rid = f"trace:{uuid.uuid4().hex[:12]}"

    def post(request_id: str, **extra: Any) -> httpx.Response:
        body = {"model": MODEL, "prompt": "hello fleet", "max_tokens": 4, **extra}
        headers = {"Authorization": f"Bearer {key}", "X-Request-Id": request_id}
        return httpx.post(f"{fleet.base_url}/v1/completions", headers=headers, json=body, timeout=120)

    r = post(rid)
    assert r.status_code == 200, r.text
    assert request_id(r) == rid and r.json()["id"] == f"cmpl-{rid}"
    assert wait_for(lambda: fleet.usage_row(f"cmpl-{rid}"), 30, what="usage") is not None
    again = post(rid)
    assert again.status_code == 409 and again.json()["error"]["code"] == "request_id_in_use", again.text
    assert post("has space").json()["error"]["code"] == "invalid_request_id"
    # In flight: the second is refused by the ingress, whichever replica the first runs on.
    busy = f"busy-{uuid.uuid4().hex[:8]}"
    body = {"model": MODEL, "prompt": "go", "max_tokens": 200, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {key}", "X-Request-Id": busy}
    with httpx.Client(base_url=fleet.base_url, headers=headers, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))  # running
            second = post(busy)
            assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
    assert second.status_code == 409 and second.json()["error"]["code"] == "request_id_in_use", second.text
    want = sorted([f"cmpl-{rid}", f"cmpl-{busy}"])
    assert wait_for(lambda: sorted(fleet.usage_ids(tenant_id)) == want, 30, what="usage")
