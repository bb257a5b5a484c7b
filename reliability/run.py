"""The reliability suite of issue 13: real `loraserve serve` processes on 127.0.0.1, hostile and unlucky
clients, one JSON line per case on stdout and a figures table in RELIABILITY.md.

Cases: abort storm, hostile uploads (both backends), mixed load, kill -9 mid-load + restart,
dependency outages (PostgreSQL restart, S3 stop and hang), schemathesis over /openapi.json. Each case is
bounded by timeouts; a case that fails to run prints a row with its error instead of figures. Run with
`make reliability`; `--cases schemathesis,outages` re-runs only those cases and keeps the other rows of
RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from base_engine.tiny_checkpoint import save_random_checkpoint  # noqa: E402
from tests.api.conftest import (  # noqa: E402
    ADMIN_KEY,
    MAX_LORA_RANK,
    MAX_UPLOAD_BYTES,
    Server,
    ServerProcess,
    _postgres_database,
    _s3_env,
    main_server_args,
)
from tests.api.faults import TcpProxy  # noqa: E402
from tests.api.hanging_proxy import HangingProxy  # noqa: E402
from tests.api.uploads import CONFIG, WEIGHTS, files_of, peft_adapter, peft_adapter_on, upload  # noqa: E402
from tests.fixtures import postgres as pg  # noqa: E402

BASE = "tiny-llama"
EVIL = "(.|.){0,24}Z"
SERVER_ENV = {
    "LORASERVE_ADMIN_KEY": ADMIN_KEY,
    "LORASERVE_MAX_QUEUE_LEN": "400",  # 16 running + 400 waiting: every storm and load request admitted
    "LORASERVE_USAGE_FLUSH_INTERVAL_S": "0.5",
}
ROWS: list[dict[str, Any]] = []


def emit(case: str, backend: str, figures: dict[str, Any], must_be_zero: list[str], seconds: float) -> None:
    row = {"case": case, "backend": backend, "seconds": round(seconds, 1), **figures}
    row["must_be_zero"] = {k: figures.get(k) for k in must_be_zero}
    row["ok"] = all(figures.get(k) == 0 for k in must_be_zero)
    ROWS.append(row)
    sys.stdout.write(json.dumps(row) + "\n")
    sys.stdout.flush()


def run_case(case: str, backend: str, fn: Callable[[], tuple[dict[str, Any], list[str]]]) -> None:
    start = time.monotonic()
    try:
        figures, zero = fn()
    except Exception as exc:  # a case that could not run is reported, never hidden
        traceback.print_exc(file=sys.stderr)
        figures, zero = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}, ["error"]
    emit(case, backend, figures, zero, time.monotonic() - start)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def admin() -> dict[str, str]:
    return auth(ADMIN_KEY)


def wait_for(cond: Callable[[], bool], timeout_s: float) -> float:
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"condition not reached in {timeout_s} s")
        time.sleep(0.1)
    return time.monotonic() - start


def usage_records(base_url: str, tenant_id: str) -> list[dict[str, Any]]:
    events, cursor = [], None
    while True:
        params = {"tenant_id": tenant_id, "limit": 1000, **({"cursor": cursor} if cursor else {})}
        r = httpx.get(f"{base_url}/admin/api/usage/export", params=params, headers=admin(), timeout=60)
        r.raise_for_status()
        events += [json.loads(line)["data"] for line in r.text.splitlines() if line]
        cursor = r.headers.get("x-next-cursor")
        if r.headers["x-has-more"] == "false":
            return events


def percentile(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))] if s else float("nan")


def idle(server: Server) -> bool:
    st = server.engine_stats()
    return st["num_in_flight"] == 0 and st["num_running"] == 0 and st["num_waiting"] == 0


# ---- 1. abort storm ------------------------------------------------------------------------------


async def _storm(server: Server, key: str, n: int) -> tuple[int, int, int, set[str]]:
    admitted: set[str] = set()
    rejected = errors = 0
    models = [BASE, "storm-a", "storm-b"]
    limits = httpx.Limits(max_connections=n + 10)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as client:

        async def one(i: int) -> None:
            nonlocal rejected, errors
            cut = i % 2 == 0
            body = {
                "model": models[i % 3], "prompt": f"storm {i}", "stream": True,
                "max_tokens": 200 if cut else 12, "ignore_eos": cut,
            }  # fmt: skip
            try:
                async with client.stream("POST", "/v1/completions", json=body, headers=auth(key)) as r:
                    if r.status_code != 200:
                        rejected += 1
                        return
                    admitted.add(r.headers["x-request-id"])
                    chunks = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            chunks += 1
                            if cut and chunks >= 3:
                                return  # leaves the block: the connection is closed mid-stream
            except httpx.HTTPError:
                errors += 1

        await asyncio.gather(*(one(i) for i in range(n)))
    return len(admitted), rejected, errors, admitted


def case_abort_storm(server: Server, tmp: Path) -> tuple[dict[str, Any], list[str]]:
    tenant_id, key = server.tenant("storm")
    for name, seed in (("storm-a", 1), ("storm-b", 2)):
        r = upload(server, key, name, files_of(peft_adapter(tmp / name, seed=seed)))
        assert r.status_code == 201, r.text
    n = 300
    admitted, rejected, errors, ids = asyncio.run(_storm(server, key, n))
    wait_for(lambda: idle(server), 60)
    st = server.engine_stats()
    per_adapter = st["adapters"].get("per_adapter", {})
    pins = sum(v["running"] + v["waiting"] for v in per_adapter.values()) + len(st["adapters"]["pinned"])

    def billed() -> set[str]:
        return {r["request_id"] for r in usage_records(server.base_url, tenant_id)}

    try:
        wait_for(lambda: billed() >= ids, 15)
    except TimeoutError:
        pass
    records = usage_records(server.base_url, tenant_id)
    rids = [r["request_id"] for r in records]
    return {
        "streams": n,
        "disconnected": n // 2,
        "admitted": admitted,
        "rejected": rejected,
        "client_errors": errors,
        "leaked_kv_blocks": st["num_kv_blocks_used"],
        "leaked_adapter_pins": pins,
        "leaked_slots": st["num_in_flight"],
        "usage_records": len(records),
        "usage_minus_admitted": len(set(rids) ^ ids) + (len(rids) - len(set(rids))),
    }, ["leaked_kv_blocks", "leaked_adapter_pins", "leaked_slots", "usage_minus_admitted", "client_errors"]


# ---- 2. hostile uploads --------------------------------------------------------------------------


def _edit(files: dict[str, bytes], fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / WEIGHTS
        path.write_bytes(files[WEIGHTS])
        tensors = fn(load_file(str(path)))
        save_file(tensors, str(path))
        return path.read_bytes()


def _config(files: dict[str, bytes], **changes: Any) -> dict[str, bytes]:
    config = json.loads(files[CONFIG])
    config.update(changes)
    return {**files, CONFIG: json.dumps(config).encode()}


def _header(obj: Any, data: bytes = b"") -> bytes:
    header = json.dumps(obj).encode()
    return len(header).to_bytes(8, "little") + header + data


def _first(ts: dict[str, torch.Tensor], value: float) -> dict[str, torch.Tensor]:
    name = sorted(ts)[0]
    ts[name][0, 0] = value
    return ts


def hostile_uploads(tmp: Path) -> list[tuple[str, str, dict[str, bytes] | None, dict[str, Any] | None]]:
    """(kind, adapter name, multipart files or None, raw httpx kwargs or None)."""
    good = files_of(peft_adapter(tmp / "good"))
    cfg = json.loads(good[CONFIG])
    nested = b"[" * 100_000 + b"]" * 100_000
    kinds: list[tuple[str, str, dict[str, bytes] | None, dict[str, Any] | None]] = [
        ("pickle weights", "h-pickle", {CONFIG: good[CONFIG], "adapter_model.bin": b"\x80\x04pickle"}, None),
        ("wrong hidden size", "h-hidden", files_of(peft_adapter_on(tmp / "wide", hidden_size=96)), None),
        ("rank above limit", "h-rank",
         files_of(peft_adapter(tmp / "rank", r=MAX_LORA_RANK * 2, target_modules=["q_proj"])), None),
        ("NaN weight", "h-nan", {**good, WEIGHTS: _edit(good, lambda t: _first(t, math.nan))}, None),
        ("Inf weight", "h-inf", {**good, WEIGHTS: _edit(good, lambda t: _first(t, math.inf))}, None),
        ("huge weights (overflow)", "h-huge",
         {**good, WEIGHTS: _edit(good, lambda t: {k: v * 1e37 for k, v in t.items()})}, None),
        ("DoRA", "h-dora", files_of(peft_adapter(tmp / "dora", use_dora=True)), None),
        ("missing config", "h-nocfg", {WEIGHTS: good[WEIGHTS]}, None),
        ("missing weights", "h-now", {CONFIG: good[CONFIG]}, None),
        ("truncated weights", "h-trunc", {**good, WEIGHTS: good[WEIGHTS][: len(good[WEIGHTS]) // 2]}, None),
        ("empty weights", "h-empty", {**good, WEIGHTS: b""}, None),
        ("header length 2^60", "h-hlen", {**good, WEIGHTS: (1 << 60).to_bytes(8, "little") + b"{}"}, None),
        ("header offsets past the end", "h-offs", {**good, WEIGHTS: _header(
            {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
             {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 1 << 40]}}, b"\0" * 64)}, None),
        ("nested JSON header", "h-nesth",
         {**good, WEIGHTS: len(nested).to_bytes(8, "little") + nested}, None),
        ("nested JSON config", "h-nestc",
         {**good, CONFIG: good[CONFIG][:-1] + b', "runtime_config": ' + nested + b"}"}, None),
        ("config not JSON", "h-cfgjson", {**good, CONFIG: b"{not json"}, None),
        ("config a JSON array", "h-cfgarr", {**good, CONFIG: b"[]"}, None),
        ("NaN lora_alpha", "h-nanalpha",
         {**good, CONFIG: good[CONFIG].replace(f'"lora_alpha": {cfg["lora_alpha"]}'.encode(),
                                              b'"lora_alpha": NaN')}, None),
        ("Infinity lora_alpha", "h-infalpha", _config(good, lora_alpha=1e309), None),
        ("rank 0", "h-r0", _config(good, r=0), None),
        ("rank 2^63", "h-rbig", _config(good, r=2**63), None),
        ("peft_type PREFIX_TUNING", "h-ptype", _config(good, peft_type="PREFIX_TUNING"), None),
        ("regex DoS target_modules", "h-regex", _config(good, target_modules=EVIL), None),
        ("unknown target modules", "h-targets", _config(good, target_modules=["no_such_proj"]), None),
        ("A/B shapes swapped", "h-swap", {**good, WEIGHTS: _edit(
            good, lambda t: {k: v.t().contiguous() for k, v in t.items()})}, None),
        ("integer weights", "h-int",
         {**good, WEIGHTS: _edit(good, lambda t: {k: v.to(torch.int32) for k, v in t.items()})}, None),
        ("oversize body", "h-big", {CONFIG: good[CONFIG], WEIGHTS: b"\0" * (MAX_UPLOAD_BYTES + 1)}, None),
        ("extra file part", "h-extra", {**good, "notes.txt": b"hello"}, None),
        ("path traversal name", "../evil", good, None),
        ("slash in name", "a/b", good, None),
        ("empty name", "", good, None),
        ("name 1000 characters", "n" * 1000, good, None),
        ("base model's name", BASE, good, None),
        ("no name field", "h-noname", None, {"files": [("files", (CONFIG, good[CONFIG]))]}),
        ("JSON body, not multipart", "h-json", None, {"json": {"name": "h-json"}}),
        ("garbage multipart body", "h-garb", None, {
            "content": b"--x\r\nnot a part\r\n",
            "headers": {"Content-Type": "multipart/form-data; boundary=x"}}),
        ("multipart without boundary", "h-nobound", None, {
            "content": b"abc", "headers": {"Content-Type": "multipart/form-data"}}),
        ("no API key", "h-nokey", good, {"noauth": True}),
        ("Basic Authorization", "h-basic", good, {"headers": {"Authorization": "Basic dXNlcjpwYXNz"}}),
        ("forged API key", "h-forged", good, {"headers": {"Authorization": "Bearer lsk-0000-forged"}}),
    ]  # fmt: skip
    return kinds


def _disk_files(data_dir: Path) -> set[str]:
    skip = re.compile(r"loraserve\.db|journal|\.log$|admin\.key|\.secret")
    return {
        str(p.relative_to(data_dir)) for p in data_dir.rglob("*") if p.is_file() and not skip.search(str(p))
    }


def case_hostile_uploads(server: Server, tmp: Path) -> tuple[dict[str, Any], list[str]]:
    _, key = server.tenant("hostile")
    kinds = hostile_uploads(tmp)
    store_before, disk_before = server.store_keys(), _disk_files(server.process.data_dir)
    accepted, statuses, server_errors = [], {}, 0
    url = f"{server.base_url}/v1/adapters"
    for kind, name, files, raw in kinds:
        if raw is None:
            r = upload(server, key, name, files or {})
        else:
            headers = {} if raw.get("noauth") else auth(key)
            headers |= raw.get("headers", {})
            kwargs = {k: v for k, v in raw.items() if k not in ("headers", "noauth")}
            if files is not None:
                kwargs["files"] = [("files", (n, c, "application/octet-stream")) for n, c in files.items()]
                kwargs["data"] = {"name": name}
            r = httpx.post(url, headers=headers, timeout=120, **kwargs)
        statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
        if r.status_code < 400:
            accepted.append(kind)
        if r.status_code >= 500:
            server_errors += 1
            sys.stderr.write(f"hostile upload {kind!r}: {r.status_code} {r.text[:200]}\n")
    listing = httpx.get(url, headers=auth(key), timeout=60).json()["data"]
    leftovers = len(server.store_keys() - store_before) + len(
        _disk_files(server.process.data_dir) - disk_before
    )
    healthy = httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    return {
        "kinds": len(kinds),
        "accepted": len(accepted),
        "accepted_kinds": accepted,
        "statuses": statuses,
        "status_5xx": server_errors,
        "adapters_listed": len(listing),
        "leftovers": leftovers,
        "healthy_after": healthy,
    }, ["accepted", "adapters_listed", "leftovers", "status_5xx"]


# ---- 3. mixed load -------------------------------------------------------------------------------


async def _load(server: Server, key: str, n: int) -> tuple[list[float], list[str], int]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(
        base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=180,
        http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 10), timeout=180),
    )  # fmt: skip
    models = [BASE, "load-a", "load-b", "load-c"]
    latencies: list[float] = []
    errors: list[str] = []
    tokens = 0

    async def one(i: int) -> None:
        nonlocal tokens
        model, stream, chat = models[i % 4], i % 2 == 0, i % 3 != 0
        start = time.monotonic()
        try:
            if chat:
                msgs = [{"role": "user", "content": f"load {i}"}]
                if stream:
                    s = await client.chat.completions.create(
                        model=model, messages=msgs, max_tokens=16, stream=True,
                        stream_options={"include_usage": True},
                    )  # fmt: skip
                    async for chunk in s:
                        if chunk.usage:
                            tokens += chunk.usage.completion_tokens
                else:
                    r = await client.chat.completions.create(model=model, messages=msgs, max_tokens=16)
                    tokens += r.usage.completion_tokens if r.usage else 0
            elif stream:
                s = await client.completions.create(
                    model=model, prompt=f"load {i}", max_tokens=16, stream=True
                )
                async for _ in s:
                    pass
            else:
                r = await client.completions.create(model=model, prompt=f"load {i}", max_tokens=16)
                tokens += r.usage.completion_tokens if r.usage else 0
            latencies.append(time.monotonic() - start)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {str(exc)[:120]}")

    await asyncio.gather(*(one(i) for i in range(n)))
    await client.close()
    return latencies, errors, tokens


def case_load(server: Server, tmp: Path) -> tuple[dict[str, Any], list[str]]:
    _, key = server.tenant("load")
    for name, seed in (("load-a", 3), ("load-b", 4), ("load-c", 5)):
        assert upload(server, key, name, files_of(peft_adapter(tmp / name, seed=seed))).status_code == 201
    n = 200
    start = time.monotonic()
    latencies, errors, tokens = asyncio.run(_load(server, key, n))
    wall = time.monotonic() - start
    wait_for(lambda: idle(server), 60)
    return {
        "requests": n,
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:3],
        "p50_s": round(percentile(latencies, 50), 3),
        "p99_s": round(percentile(latencies, 99), 3),
        "wall_s": round(wall, 2),
        "req_per_s": round(n / wall, 1),
        "leaked_kv_blocks": server.engine_stats()["num_kv_blocks_used"],
    }, ["errors", "leaked_kv_blocks"]


# ---- 4. kill -9 mid-load + restart ----------------------------------------------------------------


async def _crash_load(process: ServerProcess, key: str) -> tuple[dict[str, dict[str, Any]], set[str]]:
    completed: dict[str, dict[str, Any]] = {}  # request id -> usage the client received
    started: set[str] = set()
    async with httpx.AsyncClient(base_url=process.base_url, timeout=60) as client:

        async def short(i: int) -> None:
            await asyncio.sleep(i * 0.05)
            body = {"model": BASE, "prompt": f"crash {i}", "max_tokens": 8}
            try:
                r = await client.post("/v1/completions", json=body, headers=auth(key))
                if r.status_code == 200:
                    completed[r.json()["id"]] = r.json()["usage"]
            except httpx.HTTPError:
                pass

        async def long(i: int) -> None:
            body = {
                "model": BASE,
                "prompt": f"long {i}",
                "max_tokens": 1500,
                "ignore_eos": True,
                "stream": True,
            }
            try:
                async with client.stream("POST", "/v1/completions", json=body, headers=auth(key)) as r:
                    started.add(r.headers.get("x-request-id", ""))
                    async for _ in r.aiter_lines():
                        pass
            except httpx.HTTPError:
                pass

        async def killer() -> None:
            while len(completed) < 30:
                await asyncio.sleep(0.05)
            assert process.proc is not None
            process.proc.send_signal(signal.SIGKILL)

        tasks = [long(i) for i in range(8)] + [short(i) for i in range(200)]
        await asyncio.wait_for(asyncio.gather(killer(), *tasks), 120)
    return completed, started


def case_kill9(model: Path, tmp: Path) -> tuple[dict[str, Any], list[str]]:
    args = main_server_args(model) + ["--max-model-len", "2048"]
    process = ServerProcess(args, tmp / "data", env=SERVER_ENV).start()
    try:
        tenant = httpx.post(f"{process.base_url}/admin/api/tenants", json={"name": "kill9"}, headers=admin())
        tenant_id, key = tenant.json()["id"], tenant.json()["api_key"]
        completed, _ = asyncio.run(_crash_load(process, key))
        assert process.proc is not None and process.proc.wait(30) == -signal.SIGKILL
        restart_start = time.monotonic()
        process.start()
        restart_s = time.monotonic() - restart_start
        time.sleep(1.5)  # a flush interval or more
        records = usage_records(process.base_url, tenant_id)
    finally:
        process.stop()
    by_id: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_id.setdefault(r["request_id"], []).append(r)
    dupes = sum(len(v) - 1 for v in by_id.values())
    wrong = [
        rid for rid, usage in completed.items()
        if rid not in by_id or (by_id[rid][0]["prompt_tokens"], by_id[rid][0]["completion_tokens"])
        != (usage["prompt_tokens"], usage["completion_tokens"])
    ]  # fmt: skip
    return {
        "completed_before_kill": len(completed),
        "usage_rows": len(records),
        "duplicate_rows": dupes,
        "completed_billed_wrong": len(wrong),
        "aborted_billed": sum(1 for v in by_id.values() if v[0]["finish_reason"] == "abort"),
        "restart_s": round(restart_s, 1),
    }, ["duplicate_rows", "completed_billed_wrong"]


# ---- 5. outages ----------------------------------------------------------------------------------


def _probe(base: str, key: str, cold: str) -> dict[str, Any]:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    out: dict[str, Any] = {}
    for name, method, path, body, headers in (
        ("health", "GET", "/health", None, {}),
        ("ready", "GET", "/ready", None, {}),
        ("metrics", "GET", "/metrics", None, {}),
        ("base_chat", "POST", "/v1/chat/completions", {**chat, "model": BASE}, auth(key)),
        ("warm_adapter", "POST", "/v1/chat/completions", {**chat, "model": "warm"}, auth(key)),
        ("cold_adapter", "POST", "/v1/chat/completions", {**chat, "model": cold}, auth(key)),
    ):
        start = time.monotonic()
        try:
            r = httpx.request(method, base + path, json=body, headers=headers, timeout=30)
            code = r.json().get("error", {}).get("code") if r.status_code >= 400 else None
            if name == "ready" and r.status_code == 200:
                code = r.json().get("status")  # "ready", or "degraded" when only the store is down
            out[name] = f"{r.status_code}{' ' + code if code else ''} {time.monotonic() - start:.1f}s"
        except httpx.HTTPError as exc:
            out[name] = f"{type(exc).__name__} {time.monotonic() - start:.1f}s"
    return out


def case_outages(model: Path, tmp: Path, pg_url: str, s3_server: str) -> tuple[dict[str, Any], list[str]]:
    direct = _postgres_database(pg_url)
    pg_port = int(re.search(r"@127\.0\.0\.1:(\d+)/", direct).group(1))  # type: ignore[union-attr]
    s3 = _s3_env(s3_server, tmp)
    with ExitStack() as stack:
        hang = stack.enter_context(HangingProxy(s3_server))
        h_host, h_port = hang.url.removeprefix("http://").split(":")
        s3_cut = stack.enter_context(TcpProxy(h_host, int(h_port)))
        pg_cut = stack.enter_context(TcpProxy("127.0.0.1", pg_port))
        env = {k: v for k, v in s3.items() if k.startswith("AWS_")} | SERVER_ENV | {
            "AWS_ENDPOINT_URL": f"http://{s3_cut.address}",
            "LORASERVE_STORE_CONNECT_TIMEOUT_S": "1", "LORASERVE_STORE_READ_TIMEOUT_S": "2",
            "LORASERVE_STORE_MAX_ATTEMPTS": "2", "LORASERVE_READY_TIMEOUT_S": "1",
            "LORASERVE_UPLOAD_TIMEOUT_S": "8",
        }  # fmt: skip
        args = main_server_args(model) + [
            "--db",
            direct.replace(f"127.0.0.1:{pg_port}/", f"{pg_cut.address}/"),
            "--registry",
            f"s3://{s3['bucket']}/registry",
        ]
        process = ServerProcess(args, tmp / "data", env=env).start()
        stack.callback(process.stop)
        base = process.base_url
        tenant = httpx.post(f"{base}/admin/api/tenants", json={"name": "outage"}, headers=admin()).json()
        key = tenant["api_key"]
        server = Server(process, ADMIN_KEY, "postgres-s3-proxied")
        for name, seed in (("warm", 6), ("cold", 7)):
            assert upload(server, key, name, files_of(peft_adapter(tmp / name, seed=seed))).status_code == 201
        chat = {"model": "warm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(f"{base}/v1/chat/completions", json=chat, headers=auth(key), timeout=60).is_success

        def recovered(model_name: str) -> Callable[[], bool]:
            def ok() -> bool:
                try:
                    r = httpx.post(
                        f"{base}/v1/chat/completions", json={**chat, "model": model_name},
                        headers=auth(key), timeout=10,
                    )  # fmt: skip
                    ready = httpx.get(f"{base}/ready", timeout=10).json().get("status") == "ready"
                    return r.status_code == 200 and ready
                except httpx.HTTPError:
                    return False

            return ok

        figures: dict[str, Any] = {}
        five_hundreds = 0
        for outage, cut, restore, cold in (
            ("s3_stop", s3_cut.cut, s3_cut.restore, "cold"),
            ("s3_hang", hang.hang, hang.resume, "cold2"),
            ("postgres_cut", pg_cut.cut, pg_cut.restore, "cold2"),
        ):
            if outage == "s3_hang":  # "cold" loaded once S3 came back: another one not yet loaded
                assert upload(server, key, "cold2", files_of(peft_adapter(tmp / "c2", seed=8))).is_success
            cut()
            during = _probe(base, key, cold)
            five_hundreds += sum(1 for v in during.values() if v.startswith("500"))
            restore()
            figures[outage] = {"during": during, "recovery_s": round(wait_for(recovered(cold), 90), 1)}
        figures["status_500"] = five_hundreds
        return figures, ["status_500"]


# ---- 6. schemathesis over /openapi.json -------------------------------------------------------------

ST_MAX_EXAMPLES = 20  # per operation and generation mode (positive, negative)
ST_BUDGET_S = 180.0  # the whole case's request budget; operations not reached are counted, not hidden
ST_REQUEST_TIMEOUT_S = 30.0


def _short(value: Any, limit: int = 300) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + f"...(+{len(text) - limit})"


def case_schemathesis(server: Server) -> tuple[dict[str, Any], list[str]]:
    """Every operation of the served OpenAPI document, fuzzed with schemathesis (positive and negative
    data, bounded examples, seeded): tenant routes with a tenant key, admin routes with the admin key.
    Half the admin cases aim at a real throwaway tenant (the others at generated ids); DELETE operations
    run last so a deleted tenant does not starve the rest. Responses >= 500 must be 0; schema-conformance
    failures (status, content type, headers, body against the document) are reported, not gated."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.checks import not_a_server_error
    from schemathesis.core.failures import FailureGroup
    from schemathesis.specs.openapi.checks import ignored_auth

    base = server.base_url
    _, key = server.tenant("fuzz")
    victim_id, _ = server.tenant("fuzz-victim")
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json", config=schemathesis.Config())
    operations = [r.ok() for r in schema.get_all_operations()]
    operations.sort(key=lambda op: op.method.upper() == "DELETE")
    log_path = server.process.log_path
    deadline = time.monotonic() + ST_BUDGET_S
    requests_sent = transport_errors = 0
    statuses: dict[str, int] = {}
    server_errors: list[dict[str, Any]] = []
    conformance: dict[str, int] = {}
    conformance_samples: list[str] = []
    skipped_ops: set[str] = set()
    no_negative: set[str] = set()
    generation_errors: list[str] = []

    def fuzz(op: Any, mode: Any, headers: dict[str, str]) -> None:
        label, is_admin, seen = f"{op.method.upper()} {op.path}", op.path.startswith("/admin/"), [0]

        @settings(
            max_examples=ST_MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
            phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
        )  # fmt: skip
        @given(case=op.as_strategy(generation_mode=mode))
        def one(case: schemathesis.Case) -> None:
            nonlocal requests_sent, transport_errors
            if time.monotonic() > deadline:
                return
            seen[0] += 1
            if is_admin and "tenant_id" in (case.path_parameters or {}) and seen[0] % 2:
                case.path_parameters["tenant_id"] = victim_id
            log_at = log_path.stat().st_size if log_path.exists() else 0
            try:
                response = case.call(base_url=base, headers=headers, timeout=ST_REQUEST_TIMEOUT_S)
            except Exception as exc:  # timeouts, resets: counted; /health checked at the end
                transport_errors += 1
                sys.stderr.write(f"schemathesis {label}: {type(exc).__name__}: {_short(str(exc))}\n")
                return
            requests_sent += 1
            code = response.status_code
            statuses[str(code)] = statuses.get(str(code), 0) + 1
            if code >= 500:
                time.sleep(0.2)  # the traceback reaches the log after the response
                with open(log_path, "rb") as f:
                    f.seek(log_at)
                    log = f.read().decode(errors="replace")
                server_errors.append({
                    "operation": label, "status": code, "mode": mode.value,
                    "path_parameters": case.path_parameters, "query": case.query,
                    "body": _short(case.body, 2000), "response": _short(response.text, 500),
                    "log": log[-6000:],
                })  # fmt: skip
                sys.stderr.write(f"schemathesis {code} on {label}: {case.as_curl_command()}\n{log}\n")
            try:
                case.validate_response(
                    response, headers=headers, excluded_checks=[not_a_server_error, ignored_auth]
                )
            except (FailureGroup, Exception) as exc:  # FailureGroup is a BaseExceptionGroup
                for failure in getattr(exc, "exceptions", [exc]):
                    title = f"{label}: {getattr(failure, 'title', type(failure).__name__)}"
                    conformance[title] = conformance.get(title, 0) + 1
                    if len(conformance_samples) < 40 and conformance[title] == 1:
                        conformance_samples.append(f"{title} ({code}): {_short(str(failure), 400)}")

        try:
            one()
        except Unsatisfiable:  # negative data for an operation without parameters or body
            no_negative.add(label)
        except Exception as exc:  # the generator failed on this operation: reported, not hidden
            generation_errors.append(f"{label} {mode.value}: {type(exc).__name__}: {_short(str(exc), 200)}")

    for op in operations:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            if time.monotonic() > deadline:
                skipped_ops.add(f"{op.method.upper()} {op.path}")
                continue
            fuzz(op, mode, admin() if op.path.startswith("/admin/") else auth(key))

    if conformance_samples:
        sys.stderr.write("schemathesis conformance failures (first of each):\n")
        sys.stderr.write("".join(f"  {line}\n" for line in conformance_samples))
    for err in server_errors:
        sys.stderr.write(json.dumps(err) + "\n")
    healthy = httpx.get(f"{base}/health", timeout=10).status_code == 200
    return {
        "operations": len(operations),
        "operations_not_reached": len(skipped_ops),
        "max_examples": ST_MAX_EXAMPLES,
        "requests": requests_sent,
        "statuses": dict(sorted(statuses.items())),
        "status_5xx": len(server_errors),
        "server_errors": [
            {k: e[k] for k in ("operation", "status", "path_parameters", "query", "body")}
            for e in server_errors[:10]
        ],
        "transport_errors": transport_errors,
        "no_negative_data": len(no_negative),
        "generation_errors": generation_errors,
        "conformance_failures": sum(conformance.values()),
        "conformance_by_check": dict(sorted(conformance.items())),
        "healthy_after": healthy,
    }, ["status_5xx"]


# ---- the run -------------------------------------------------------------------------------------


CASES = ("abort storm", "hostile uploads", "mixed load", "kill -9 + restart", "outages", "schemathesis")


def _previous_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of an earlier RELIABILITY.md (kept for the cases a `--cases` run leaves out)."""
    if not path.exists():
        return []
    block = path.read_text().split("## JSON lines", 1)[-1]
    return [json.loads(line) for line in block.splitlines() if line.startswith("{")]


def write_report(path: Path, total_s: float, rerun: list[str] | None = None) -> None:
    rows = ROWS
    when = f"on {time.strftime('%Y-%m-%d')}: real"
    if rerun is not None:  # other rows as the earlier run wrote them, in their order; re-run rows replace
        fresh = {(r["case"], r["backend"]): r for r in ROWS}
        rows = [fresh.pop((r["case"], r["backend"]), r) for r in _previous_rows(path)] + list(fresh.values())
        when = f"(rows of {', '.join(rerun)} re-run with `--cases` on {time.strftime('%Y-%m-%d')}): real"
        total_s = sum(r.get("seconds", 0) for r in rows)
    lines = [
        "# Reliability figures (issue 13)",
        "",
        f"Written by `make reliability` (`reliability/run.py`) {when} "
        f"`loraserve serve` processes on 127.0.0.1 with the tiny random Llama, {os.cpu_count()} CPUs, "
        f"{total_s:.0f} s in all. Each row's JSON line is below the table.",
        "",
        "| case | backend | figures | must be zero | ok |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        skip = {"case", "backend", "must_be_zero", "ok", "seconds"}
        figures = ", ".join(f"{k}={v}" for k, v in row.items() if k not in skip and not isinstance(v, dict))
        zero = ", ".join(f"{k}={v}" for k, v in row["must_be_zero"].items())
        lines.append(
            f"| {row['case']} | {row['backend']} | {figures} | {zero} | {'yes' if row['ok'] else 'NO'} |"
        )
    outage = [r for r in rows if r["case"] == "outages" and "s3_stop" in r]
    if outage:
        lines += ["", "## Outages: what kept serving (status, error code, latency during the outage)", ""]
        lines += ["| outage | " + " | ".join(outage[0]["s3_stop"]["during"]) + " | recovery s |"]
        lines += ["|---" * (len(outage[0]["s3_stop"]["during"]) + 2) + "|"]
        for name in ("s3_stop", "s3_hang", "postgres_cut"):
            during = outage[0][name]["during"]
            lines.append(
                f"| {name} | " + " | ".join(during.values()) + f" | {outage[0][name]['recovery_s']} |"
            )
    lines += ["", "## JSON lines", "", "```"] + [json.dumps(r) for r in rows] + ["```", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases", help=f"comma-separated case names to run (default: all): {', '.join(CASES)}"
    )
    opts = parser.parse_args(argv)
    selected = [c.strip() for c in opts.cases.split(",")] if opts.cases else list(CASES)
    unknown = [c for c in selected if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    needs_pg = {"abort storm", "hostile uploads", "outages"} & set(selected)

    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="loraserve-reliability-"))
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        for name in ("storm", "hostile-l", "hostile-s", "load", "storm-s", "kill9", "outage"):
            (tmp / name).mkdir()
        model = save_random_checkpoint(tmp / "model", arch="llama")
        s3_server = pg_url = ""
        if needs_pg:
            from moto.server import ThreadedMotoServer

            moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            moto.start()
            stack.callback(moto.stop)
            host, port = moto.get_host_and_port()
            s3_server = f"http://{host}:{port}"
            pg_url = _postgres_cluster(stack)

        def server(backend: str) -> Server:
            d = tmp / f"{backend}-{uuid.uuid4().hex[:6]}"
            d.mkdir(parents=True)
            args, env, s3 = main_server_args(model), dict(SERVER_ENV), None
            if backend == "postgres-s3":
                s3 = _s3_env(s3_server, d)
                args += ["--db", _postgres_database(pg_url), "--registry", f"s3://{s3['bucket']}/registry"]
                env |= {k: v for k, v in s3.items() if k.startswith("AWS_")}
            process = ServerProcess(args, d / "data", env=env).start()
            stack.callback(process.stop)
            return Server(process, ADMIN_KEY, backend, s3)

        def want(case: str) -> bool:
            return case in selected

        sqlite = (
            server("sqlite-local")
            if {"abort storm", "hostile uploads", "mixed load"} & set(selected)
            else None
        )
        pgs3 = server("postgres-s3") if {"abort storm", "hostile uploads"} & set(selected) else None
        if want("abort storm"):
            run_case("abort storm", "sqlite-local", lambda: case_abort_storm(sqlite, tmp / "storm"))
        if want("hostile uploads"):
            run_case(
                "hostile uploads", "sqlite-local", lambda: case_hostile_uploads(sqlite, tmp / "hostile-l")
            )
            run_case("hostile uploads", "postgres-s3", lambda: case_hostile_uploads(pgs3, tmp / "hostile-s"))
        if want("mixed load"):
            run_case("mixed load", "sqlite-local", lambda: case_load(sqlite, tmp / "load"))
        if want("abort storm"):
            run_case("abort storm", "postgres-s3", lambda: case_abort_storm(pgs3, tmp / "storm-s"))
        if want("kill -9 + restart"):
            run_case("kill -9 + restart", "sqlite-local", lambda: case_kill9(model, tmp / "kill9"))
        if want("outages"):
            run_case("outages", "postgres-s3", lambda: case_outages(model, tmp / "outage", pg_url, s3_server))
        if want("schemathesis"):  # a server of its own: the fuzzer creates tenants, keys and deletes
            run_case("schemathesis", "sqlite-local", lambda: case_schemathesis(server("sqlite-local")))
    rerun = None if opts.cases is None else selected
    write_report(ROOT / "RELIABILITY.md", time.monotonic() - start, rerun)
    return 0 if all(r["ok"] for r in ROWS) else 1


def _postgres_cluster(stack: ExitStack) -> str:
    bindir = pg._pg_bindir()
    if bindir is None:
        raise SystemExit("no PostgreSQL server binaries (run `make system-deps`)")
    root = Path(tempfile.mkdtemp(prefix="loraserve-pg-", dir="/tmp"))
    os.chmod(root, 0o755)
    as_user: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(root, user="postgres", group="postgres")
        as_user = ["runuser", "-u", "postgres", "--"]
    stack.callback(shutil.rmtree, root, True)
    port = pg._start(bindir, root, as_user)
    stack.callback(
        pg._run, [str(bindir / "pg_ctl"), "-D", str(root / "data"), "-m", "immediate", "stop"], as_user
    )
    return f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"


if __name__ == "__main__":
    raise SystemExit(main())
