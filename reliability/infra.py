"""Hostile tenants and stuck dependencies around one server run with the shipped defaults: PostgreSQL and
S3 behind proxies that can hang (what SIGSTOP or a frozen endpoint looks like: connections accepted,
nothing answered), and an import-source bucket both tenants are granted.

Rows: import across tenants (B reaches none of A's sources: the same 404 as a missing one), trickling
uploads (tenant A's stalled bodies never refuse tenant B, and end by their deadline), hung store (an
adapter on local disk is served at once behind hung downloads; cold ones get their 503 within 10 s),
hung postgres (requests that need the database get 503 within its timeout, /health stays fast).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from reliability.common import BASE, SERVER_ENV, admin, auth
from tests.harness.hanging_proxy import HangingProxy
from tests.harness.postgres import new_database
from tests.harness.s3 import s3_backend, s3_client
from tests.harness.servers import ADMIN_KEY, Server, ServerProcess, main_server_args
from tests.harness.uploads import (
    answered_within,
    files_of,
    peft_adapter,
    response_status,
    trickling_upload,
    upload,
)
from tests.harness.wait import wait_for

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COLD_503_BOUND_S = 10.0  # what the shipped defaults must keep a cold fetch's 503 under
DB_503_BOUND_S = 6.0  # db_timeout_s (5 s) and a second of slack


@dataclass
class InfraServer:
    server: Server
    pg: HangingProxy  # between the server and its database
    s3: HangingProxy  # between the server and S3 (registry and import source)
    source: dict[str, str]  # AWS_* env and the import-source bucket
    prefixes: list[str]  # adapter_import_prefixes: the source's shared prefix and the registry's bucket
    tmp: Path


def start_infra_server(stack: ExitStack, tmp: Path, model: Path, pg_url: str, s3_server: str) -> InfraServer:
    """The server of this module's rows (stopped by `stack`)."""
    direct = new_database(pg_url)
    host_port = direct.split("@", 1)[1].split("/", 1)[0]
    pg = stack.enter_context(HangingProxy(host_port))
    s3 = stack.enter_context(HangingProxy(s3_server))
    registry, source = s3_backend(s3_server, tmp), s3_backend(s3_server, tmp)
    prefixes = [f"s3://{source['bucket']}/shared", f"s3://{registry['bucket']}"]  # the registry's on purpose
    env = {k: v for k, v in registry.items() if k.startswith("AWS_")} | SERVER_ENV | {
        "AWS_ENDPOINT_URL": s3.url,
        "LORASERVE_ADAPTER_IMPORT_PREFIXES": json.dumps(prefixes),
    }  # fmt: skip
    args = main_server_args(model) + [
        "--db", direct.replace(host_port, pg.url.removeprefix("http://")),
        "--registry", f"s3://{registry['bucket']}/registry",
    ]  # fmt: skip
    process = ServerProcess(args, tmp / "data", env=env).start()
    stack.callback(process.stop)
    return InfraServer(
        Server(process, ADMIN_KEY, "postgres-s3-hanging", registry), pg, s3, source, prefixes, tmp
    )


def _granted_tenant(infra: InfraServer, name: str) -> str:
    tenant_id, key = infra.server.tenant(name)
    r = infra.server.admin("PUT", f"/tenants/{tenant_id}/import-prefixes", json={"prefixes": infra.prefixes})
    assert r.status_code == 200, r.text
    return key


def _import(base: str, key: str, name: str, uri: str) -> tuple[int, Any]:
    r = httpx.post(
        f"{base}/v1/adapters/import", json={"name": name, "uri": uri}, headers=auth(key), timeout=60
    )
    return r.status_code, r.json().get("error")


# ---- import across tenants -----------------------------------------------------------------------


def case_import_across_tenants(infra: InfraServer) -> tuple[dict[str, Any], list[str]]:
    base, bucket = infra.server.base_url, infra.source["bucket"]
    key_a, key_b = _granted_tenant(infra, "imp-a"), _granted_tenant(infra, "imp-b")
    files = files_of(peft_adapter(infra.tmp / "imp", seed=11))
    sources = []
    for i in range(3):
        for name, content in files.items():
            s3_client(infra.source).put_object(Bucket=bucket, Key=f"shared/a{i}/{name}", Body=content)
        sources.append(f"s3://{bucket}/shared/a{i}")
    a_imported = sum(_import(base, key_a, f"a{i}", uri)[0] == 201 for i, uri in enumerate(sources))
    assert upload(
        infra.server, key_a, "uploaded", files_of(peft_adapter(infra.tmp / "up", seed=12))
    ).is_success
    missing = _import(base, key_b, "x", f"s3://{bucket}/shared/never-written")
    registry = infra.server.s3["bucket"]  # type: ignore[index]
    attempts = [*sources, *(uri + "/" for uri in sources), f"s3://{registry}/registry", f"s3://{registry}"]
    answers = [_import(base, key_b, f"b{i}", uri) for i, uri in enumerate(attempts)]
    listing = httpx.get(f"{base}/v1/adapters", headers=auth(key_b), timeout=30).json()["data"]
    return {
        "a_import_failures": len(sources) - a_imported,
        "b_attempts": len(answers),
        "b_answers": dict(Counter(f"{status} {(error or {}).get('code')}" for status, error in answers)),
        "cross_tenant_imports": sum(200 <= status < 300 for status, _ in answers),
        "taken_unlike_missing": sum(
            answer != missing for answer in answers[: 2 * len(sources)]
        ),  # A's sources (both spellings) must read exactly as a missing one
        "b_adapters": len(listing),
    }, ["a_import_failures", "cross_tenant_imports", "taken_unlike_missing", "b_adapters"]


# ---- trickling uploads ---------------------------------------------------------------------------


def case_trickling_uploads(infra: InfraServer) -> tuple[dict[str, Any], list[str]]:
    server = infra.server
    _, key_a = server.tenant("trickle-a")
    _, key_b = server.tenant("trickle-b")
    files = files_of(peft_adapter(infra.tmp / "trickle", seed=13))
    started = time.monotonic()
    socks = [trickling_upload(server.base_url, key_a, 1024, timeout_s=180) for _ in range(8)]  # 2x the slots
    try:
        refused = answered_within(socks, 1.0)
        refused_codes = Counter(response_status(s) for s in refused)
        with ThreadPoolExecutor(2) as pool:  # B uploads meanwhile, two at a time
            b_codes = Counter(pool.map(lambda i: upload(server, key_b, f"b{i}", files).status_code, range(6)))
        admitted = [s for s in socks if s not in refused]
        ended = Counter(response_status(s) for s in admitted)  # the body deadline ends them
        held_s = time.monotonic() - started
    finally:
        for sock in socks:
            sock.close()
    after = upload(server, key_a, "after", files).status_code
    return {
        "a_tricklers": len(socks),
        "a_refused_at_once": dict(refused_codes),
        "a_admitted": len(admitted),
        "a_admitted_ended": dict(ended),
        "a_held_slots_s": round(held_s, 1),
        "b_uploads": dict(b_codes),
        "b_refused": sum(n for code, n in b_codes.items() if code == 429),
        "a_not_ended_408": sum(n for code, n in ended.items() if code != 408),
        "a_upload_after_failed": int(after not in (200, 201)),
    }, ["b_refused", "a_not_ended_408", "a_upload_after_failed"]


# ---- hung store (shipped store timeouts) ---------------------------------------------------------


def _timed_chat(base: str, key: str, model: str) -> tuple[int, str | None, float]:
    start = time.monotonic()
    try:
        r = httpx.post(
            f"{base}/v1/chat/completions", json={**CHAT, "model": model}, headers=auth(key), timeout=300
        )
        code = r.json().get("error", {}).get("code") if r.status_code >= 400 else None
        return r.status_code, code, time.monotonic() - start
    except httpx.HTTPError as exc:
        return 0, type(exc).__name__, time.monotonic() - start


def _residency(base: str, key: str, name: str) -> str:
    r = httpx.get(f"{base}/v1/adapters/{name}", headers=auth(key), timeout=30)
    return str(r.json()["versions"][0]["residency"])


def case_hung_store(infra: InfraServer) -> tuple[dict[str, Any], list[str]]:
    server, base = infra.server, infra.server.base_url
    _, key = server.tenant("store")
    names = ["local", "w1", "w2", "w3", "w4", "c1", "c2", "c3", "c4", "c5"]
    for seed, name in enumerate(names, start=20):
        assert (
            upload(server, key, name, files_of(peft_adapter(infra.tmp / name, seed=seed))).status_code == 201
        )
    for name in names[:5]:  # "local" first, then four more: the host tier (4) lets "local" go to disk
        assert _timed_chat(base, key, name)[0] == 200, name
    wait_for(lambda: _residency(base, key, "local") == "disk", 30, interval=0.2, what="local on disk only")
    infra.s3.hang()
    try:
        with ThreadPoolExecutor(6) as pool:
            cold = [pool.submit(_timed_chat, base, key, name) for name in names[5:9]]  # pin the fetch threads
            time.sleep(0.5)
            local = pool.submit(_timed_chat, base, key, "local")
            fifth = pool.submit(_timed_chat, base, key, "c5")  # queues behind the four
            cold_results = [f.result() for f in cold] + [fifth.result()]
            local_result = local.result()
    finally:
        infra.s3.resume()
    resumed = time.monotonic()
    wait_for(lambda: _timed_chat(base, key, "c1")[0] == 200, 90, interval=0.5, what="cold served again")
    results = [local_result, *cold_results]
    return {
        "local_adapter": f"{local_result[0]} {local_result[2]:.1f}s",
        "cold_adapters": [f"{s}{' ' + c if c else ''} {t:.1f}s" for s, c, t in cold_results],
        "cold_503_max_s": round(max(t for _, _, t in cold_results), 1),
        "local_slow_or_failed": int(local_result[0] != 200 or local_result[2] > 2.0),
        "cold_not_503_within_10s": sum(
            (s, c) != (503, "adapter_unavailable") or t > COLD_503_BOUND_S for s, c, t in cold_results
        ),
        "status_500": sum(s >= 500 and s != 503 for s, _, _ in results),
        "recovery_s": round(time.monotonic() - resumed, 1),
    }, ["local_slow_or_failed", "cold_not_503_within_10s", "status_500"]


# ---- hung postgres (shipped db_timeout_s) --------------------------------------------------------


def _timed_request(
    base: str, method: str, path: str, kwargs: dict[str, Any]
) -> tuple[int, str | None, float]:
    start = time.monotonic()
    try:
        r = httpx.request(method, base + path, timeout=120, **kwargs)
        code = r.json().get("error", {}).get("code") if r.status_code >= 400 else None
        if r.status_code == 503 and "retry-after" not in r.headers:
            code = f"{code} without Retry-After"
        return r.status_code, code, time.monotonic() - start
    except httpx.HTTPError as exc:
        return 0, type(exc).__name__, time.monotonic() - start


def _poll_health(base: str, stop: threading.Event, seconds: list[float]) -> None:
    while not stop.is_set():
        start = time.monotonic()
        try:
            httpx.get(f"{base}/health", timeout=30)
        except httpx.HTTPError:
            pass
        seconds.append(time.monotonic() - start)
        stop.wait(0.2)


def case_hung_postgres(infra: InfraServer) -> tuple[dict[str, Any], list[str]]:
    base = infra.server.base_url
    _, key = infra.server.tenant("pg")
    calls: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", "/v1/chat/completions", {"json": {**CHAT, "model": BASE}, "headers": auth(key)}),
        ("GET", "/v1/models", {"headers": auth(key)}),
        ("GET", "/v1/adapters", {"headers": auth(key)}),
        ("GET", "/admin/api/tenants", {"headers": admin()}),
    ]
    assert all(_timed_request(base, *call)[0] == 200 for call in calls)
    baseline: list[float] = []  # /health on this (shared, noisy) machine before the hang
    stop = threading.Event()
    threading.Timer(3.0, stop.set).start()
    _poll_health(base, stop, baseline)
    health: list[float] = []
    stop = threading.Event()
    poller = threading.Thread(target=_poll_health, args=(base, stop, health), daemon=True)
    infra.pg.hang()
    poller.start()
    results = []
    try:
        with ThreadPoolExecutor(8) as pool:
            for _ in range(3):  # the first round meets pooled connections, later ones new connections
                results += list(pool.map(lambda call: _timed_request(base, *call), calls * 2))
    finally:
        infra.pg.resume()
        stop.set()
        poller.join()
    resumed = time.monotonic()
    wait_for(lambda: _timed_request(base, *calls[0])[0] == 200, 60, interval=0.2, what="database back")
    return {
        "requests": len(results),
        "answers": dict(Counter(f"{s} {c}" for s, c, _ in results)),
        "slowest_s": round(max(t for _, _, t in results), 1),
        "over_6s": sum(t > DB_503_BOUND_S for _, _, t in results),
        "not_503_database_unavailable": sum((s, c) != (503, "database_unavailable") for s, c, _ in results),
        "health_max_s": round(max(health), 2),
        "health_max_s_before": round(max(baseline), 2),
        "health_over_2s": sum(t > 2.0 for t in health),
        "recovery_s": round(time.monotonic() - resumed, 1),
    }, ["over_6s", "not_503_database_unavailable", "health_over_2s"]
