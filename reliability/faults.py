"""Failures around the server: kill -9 in the middle of a load and a restart (usage billed once, and
right), and dependency outages (S3 stopped, S3 hanging, PostgreSQL cut) behind TCP proxies: what keeps
serving during each and how long recovery takes."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from reliability.common import BASE, SERVER_ENV, admin, auth, usage_records
from tests.harness.hanging_proxy import HangingProxy
from tests.harness.postgres import new_database
from tests.harness.s3 import s3_backend
from tests.harness.servers import ADMIN_KEY, Server, ServerProcess, main_server_args
from tests.harness.tcp_proxy import TcpProxy
from tests.harness.uploads import files_of, peft_adapter, upload
from tests.harness.wait import wait_for

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


def _recovered(base: str, key: str, chat: dict[str, Any], model_name: str) -> Callable[[], bool]:
    """A poll: a chat with `model_name` answers 200 and /ready says "ready" again."""

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


def case_outages(model: Path, tmp: Path, pg_url: str, s3_server: str) -> tuple[dict[str, Any], list[str]]:
    direct = new_database(pg_url)
    pg_port = int(re.search(r"@127\.0\.0\.1:(\d+)/", direct).group(1))  # type: ignore[union-attr]
    s3 = s3_backend(s3_server, tmp)
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
            outage_end = time.monotonic()
            wait_for(_recovered(base, key, chat, cold), 90, interval=0.1)
            recovery_s = time.monotonic() - outage_end
            figures[outage] = {"during": during, "recovery_s": round(recovery_s, 1)}
        figures["status_500"] = five_hundreds
        return figures, ["status_500"]
