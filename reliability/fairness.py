"""Fairness between tenants on one server, as the hostile-tenant probes of issue 28 measured it: one
request's fan-out (item 8), stop strings and ids (item 9), long streams holding the batch (item 11) and a
lone tenant's use of the free capacity (item 20). Each case makes its own tenants, ends every stream it
opened and checks afterwards that no KV block outlives its request.

The server: the suite's model and limits with 16 running + 16 waiting engine requests (32 in-flight
slots, 4 above them in reserve for tenants within their share), the shipped request bounds.
"""

from __future__ import annotations

import asyncio
import random
import time
from contextlib import AsyncExitStack, ExitStack
from pathlib import Path
from typing import Any

import httpx

from reliability.common import BASE, SERVER_ENV, auth, idle, percentile
from tests.harness.servers import ADMIN_KEY, Server, ServerProcess, main_server_args
from tests.harness.wait import wait_for

MAX_NUM_SEQS = 16  # main_server_args
MAX_IN_FLIGHT = 32  # + the queue below
FAIR_ENV = {**SERVER_ENV, "LORASERVE_MAX_QUEUE_LEN": str(MAX_IN_FLIGHT - MAX_NUM_SEQS)}
LONG = {"max_tokens": 220, "ignore_eos": True}  # a stream that outlives each probe


def fairness_server(stack: ExitStack, tmp: Path, model: Path) -> Server:
    """The server these cases share (stopped by `stack`)."""
    process = ServerProcess(main_server_args(model), tmp / "data", env=FAIR_ENV).start()
    stack.callback(process.stop)
    return Server(process, ADMIN_KEY, "sqlite-local")


def _client(server: Server) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=MAX_IN_FLIGHT * 2)
    return httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits)


async def _ttft(client: httpx.AsyncClient, key: str, prompt: str, **extra: Any) -> float:
    """Seconds from sending a streamed completion to its first token (raises on a refusal)."""
    body = {"model": BASE, "prompt": prompt, "max_tokens": 4, "stream": True, **extra}
    start = time.monotonic()
    async with client.stream("POST", "/v1/completions", json=body, headers=auth(key)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                return time.monotonic() - start
    raise RuntimeError("stream ended without a token")


async def _unloaded_ttft(client: httpx.AsyncClient, key: str, n: int = 5) -> float:
    await _ttft(client, key, "warm-up")  # the tenant's first request also loads its key and quotas
    return percentile([await _ttft(client, key, f"alone {i}") for i in range(n)], 50)


async def _hold(stack: AsyncExitStack, client: httpx.AsyncClient, key: str, count: int) -> list[int]:
    """Opens `count` long streams, one after the other, kept open (and read) until `stack` closes;
    their statuses."""
    statuses = []
    for i in range(count):
        body = {"model": BASE, "prompt": f"hold {i}", "stream": True, **LONG}
        r = await stack.enter_async_context(
            client.stream("POST", "/v1/completions", json=body, headers=auth(key))
        )
        statuses.append(r.status_code)
        if r.status_code == 200:  # read in the background; cancelled before the stream is closed
            stack.push_async_callback(_cancel, asyncio.ensure_future(_read_all(r)))
    return statuses


async def _read_all(response: httpx.Response) -> None:
    async for _ in response.aiter_bytes():
        pass


async def _cancel(task: asyncio.Future[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _until(server: Server, what: str, ok: Any, timeout_s: float = 60.0) -> None:
    """Polls the engine's stats without blocking the event loop (the held streams keep being read)."""
    deadline = time.monotonic() + timeout_s
    while not ok(await asyncio.to_thread(server.engine_stats)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not {what} after {timeout_s} s")
        await asyncio.sleep(0.05)


def _engine(server: Server) -> dict[str, Any]:
    return server.engine_stats()


def _wait_idle_and_count_leaks(server: Server) -> int:
    wait_for(lambda: idle(server), 120, interval=0.2)
    return int(_engine(server)["num_kv_blocks_used"])


# ---- item 11: long streams of one tenant ---------------------------------------------------------


async def _running_fairness(server: Server, x: str, y: str) -> dict[str, Any]:
    async with _client(server) as client, AsyncExitStack() as held:
        unloaded = await _unloaded_ttft(client, y)
        statuses = await _hold(held, client, x, 24)  # 16 running, 8 waiting behind them
        await _until(server, "a full batch", lambda st: st["num_running"] == MAX_NUM_SEQS)
        preempted = _engine(server)["num_preemptions"]
        ttfts = await asyncio.gather(*(_ttft(client, y, f"y {i}") for i in range(5)))
        stats = _engine(server)
    return {
        "x_streams": len(statuses),
        "x_admitted": statuses.count(200),
        "y_requests": len(ttfts),
        "y_ttft_unloaded_s": round(unloaded, 3),
        "y_ttft_p50_s": round(percentile(ttfts, 50), 3),
        "y_ttft_max_s": round(max(ttfts), 3),
        "y_ttft_over_2s": sum(t > 2.0 for t in ttfts),
        "x_sequences_yielded": stats["num_preemptions"] - preempted,
    }


def case_running_fairness(server: Server) -> tuple[dict[str, Any], list[str]]:
    (_, x), (_, y) = server.tenant("flood"), server.tenant("victim")
    figures = asyncio.run(_running_fairness(server, x, y))
    figures["leaked_kv_blocks"] = _wait_idle_and_count_leaks(server)
    figures["x_refused"] = figures["x_streams"] - figures["x_admitted"]
    return figures, ["y_ttft_over_2s", "x_refused", "leaked_kv_blocks"]


# ---- item 20: a lone tenant and the free capacity ------------------------------------------------


async def _lone_tenant(server: Server, x: str, y: str) -> dict[str, Any]:
    async with _client(server) as client, AsyncExitStack() as held:
        statuses = await _hold(held, client, x, MAX_IN_FLIGHT)
        body = {"model": BASE, "prompt": "one more", "max_tokens": 2}
        extra = await client.post("/v1/completions", json=body, headers=auth(x))
        message = extra.json()["error"]["message"] if extra.status_code != 200 else ""
        try:
            newcomer: float | None = await _ttft(client, y, "newcomer")
        except RuntimeError:
            newcomer = None
    return {
        "slots": MAX_IN_FLIGHT,
        "lone_admitted": statuses.count(200),
        "lone_refused_below_capacity": MAX_IN_FLIGHT - statuses.count(200),
        "extra_status": extra.status_code,
        "extra_message": message[:120],
        "message_claims_others_wait": int("wait" in message and "other tenant" in message),
        "newcomer_refused": int(newcomer is None),
        "newcomer_ttft_s": None if newcomer is None else round(newcomer, 3),
    }


def case_lone_tenant(server: Server) -> tuple[dict[str, Any], list[str]]:
    (_, x), (_, y) = server.tenant("lone"), server.tenant("newcomer")
    figures = asyncio.run(_lone_tenant(server, x, y))
    figures["leaked_kv_blocks"] = _wait_idle_and_count_leaks(server)
    zero = ["lone_refused_below_capacity", "message_claims_others_wait", "newcomer_refused"]
    return figures, [*zero, "leaked_kv_blocks"]


# ---- item 8: one request's fan-out ---------------------------------------------------------------


async def _fan_out(server: Server, x: str, y: str) -> dict[str, Any]:
    async with _client(server) as client:
        unloaded = await _unloaded_ttft(client, y)
        refused = []
        for n, prompts in ((17, "p"), (128, "p"), (9, ["a", "b"])):  # 17, 128, 18 choices: past 16
            body = {"model": BASE, "prompt": prompts, "n": n, "max_tokens": 2}
            refused.append((await client.post("/v1/completions", json=body, headers=auth(x))).status_code)
        body = {"model": BASE, "prompt": "fan", "n": 16, "logprobs": 20, **LONG}
        fan = asyncio.ensure_future(client.post("/v1/completions", json=body, headers=auth(x)))
        await _until(server, "fanned out", lambda st: st["num_running"] >= MAX_NUM_SEQS)
        loaded = [await _ttft(client, y, f"victim {i}") for i in range(5)]
        ended_early = fan.done()  # then a probe did not run beside the fan-out: the figure means nothing
        answer = await fan
    return {
        "victim_ttft_unloaded_s": round(unloaded, 3),
        "victim_ttft_p50_s": round(percentile(loaded, 50), 3),
        "victim_ttft_max_s": round(max(loaded), 3),
        "victim_ttft_max_ratio": round(max(loaded) / unloaded, 2),
        "victim_ttft_over_3x": sum(t > 3 * unloaded for t in loaded),
        "fan_out_ended_before_probes": int(ended_early),
        "fan_out_status": answer.status_code,
        "fan_out_choices": len(answer.json().get("choices", [])),
        "fan_out_bytes": len(answer.content),
        "past_cap_statuses": refused,
        "past_cap_not_400": sum(s != 400 for s in refused),
    }


def case_fan_out(server: Server) -> tuple[dict[str, Any], list[str]]:
    (_, x), (_, y) = server.tenant("fan"), server.tenant("fan-victim")
    figures = asyncio.run(_fan_out(server, x, y))
    figures["leaked_kv_blocks"] = _wait_idle_and_count_leaks(server)
    zero = ["victim_ttft_over_3x", "fan_out_ended_before_probes", "past_cap_not_400"]
    return figures, [*zero, "leaked_kv_blocks"]


# ---- item 9: stop strings and stop token ids -----------------------------------------------------


async def _per_token_s(client: httpx.AsyncClient, key: str, beside: dict[str, Any], other: str) -> float:
    """A victim's decode seconds per token while a request with `beside` runs next to it."""
    body = {"model": BASE, "prompt": "beside", **LONG, **beside}
    neighbour = asyncio.ensure_future(client.post("/v1/completions", json=body, headers=auth(other)))
    await asyncio.sleep(0.2)  # it has started
    victim = {"model": BASE, "prompt": "victim", "stream": True, "max_tokens": 100, "ignore_eos": True}
    stamps = []
    async with client.stream("POST", "/v1/completions", json=victim, headers=auth(key)) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.monotonic())
    await neighbour
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


async def _stops(server: Server, x: str, y: str) -> dict[str, Any]:
    rng = random.Random(0)
    heavy = {
        "stop": ["".join(rng.choice("QXZJ") for _ in range(256)) for _ in range(16)],
        "stop_token_ids": list(range(10**6, 10**6 + 256)),  # never sampled: the stream runs to the end
    }
    past = [
        {"stop": [f"s{i}" for i in range(17)]},
        {"stop": ["x" * 257]},
        {"stop_token_ids": list(range(10**6, 10**6 + 257))},
        {"stop": [f"s{i}" for i in range(10_000)]},
        {"stop_token_ids": list(range(800_000))},
    ]
    async with _client(server) as client:
        statuses = []
        for extra in past:
            body = {"model": BASE, "prompt": "p", "max_tokens": 2, **extra}
            statuses.append((await client.post("/v1/completions", json=body, headers=auth(x))).status_code)
        plain = await _per_token_s(client, y, {}, x)
        loaded = await _per_token_s(client, y, heavy, x)
    return {
        "past_limit_statuses": statuses,
        "past_limit_not_400": sum(s != 400 for s in statuses),
        "victim_ms_per_token_plain": round(plain * 1000, 2),
        "victim_ms_per_token_beside_max_stops": round(loaded * 1000, 2),
        "victim_slowdown": round(loaded / plain, 2),
        "victim_slowdown_over_2x": int(loaded > 2 * plain),
    }


def case_stop_bounds(server: Server) -> tuple[dict[str, Any], list[str]]:
    (_, x), (_, y) = server.tenant("stops"), server.tenant("stops-victim")
    figures = asyncio.run(_stops(server, x, y))
    figures["leaked_kv_blocks"] = _wait_idle_and_count_leaks(server)
    return figures, ["past_limit_not_400", "victim_slowdown_over_2x", "leaked_kv_blocks"]


FAIRNESS_CASES = {
    "running fairness": case_running_fairness,
    "lone tenant": case_lone_tenant,
    "fan-out": case_fan_out,
    "stop bounds": case_stop_bounds,
}
