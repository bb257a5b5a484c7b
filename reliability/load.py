"""Concurrent client load against one server: the abort storm (half the streams cut mid-flight) and the
mixed load (chat and completions, streaming or not, base and adapters) through the official `openai`
client. Both check afterwards that no KV block, adapter pin or slot outlives its request."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from reliability.common import BASE, auth, idle, percentile, usage_records
from tests.harness.servers import Server
from tests.harness.uploads import files_of, peft_adapter, upload
from tests.harness.wait import wait_for

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
    wait_for(lambda: idle(server), 60, interval=0.1)
    st = server.engine_stats()
    per_adapter = st["adapters"].get("per_adapter", {})
    pins = sum(v["running"] + v["waiting"] for v in per_adapter.values()) + len(st["adapters"]["pinned"])

    def billed() -> set[str]:
        return {r["request_id"] for r in usage_records(server.base_url, tenant_id)}

    try:
        wait_for(lambda: billed() >= ids, 15, interval=0.1)
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
    wait_for(lambda: idle(server), 60, interval=0.1)
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
