"""slow_fsync.py's load and measurement: one round of short background chat requests (so requests keep
finishing and the usage journal keeps fsyncing) and long streams whose inter-token gaps are timed on the
client; how busy the rest of the machine was meanwhile; the per-server summary of a list of rounds."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.fsync_server import Server

WORDS = "the quick brown fox jumps over a lazy dog while serving engines turn prompts into tokens".split()


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class Round:
    gaps_s: list[float] = field(default_factory=list)
    num_streams_ok: int = 0
    num_background: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    others_cores: float = 0.0  # CPU cores busy outside this benchmark and its server meanwhile


def _busy_ticks() -> int:
    """Busy CPU time of the whole machine, in clock ticks (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # minus idle and iowait


def _process_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime, all threads


def _own_ticks() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (usage.ru_utime + usage.ru_stime) * os.sysconf("SC_CLK_TCK")


def _body(rng: random.Random, max_tokens: int, stream: bool) -> dict[str, Any]:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24)))
    body: dict[str, Any] = {
        "model": "bench",
        "messages": [{"role": "user", "content": words}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.8,
    }
    if stream:
        # logprobs: a chunk for every token, also one that decodes to no text yet.
        body |= {"stream": True, "logprobs": True, "top_logprobs": 0}
    return body


async def long_stream(client: httpx.AsyncClient, body: dict[str, Any], out: Round) -> None:
    gaps: list[float] = []
    last: float | None = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                out.errors.append(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.errors.append(str(chunk["error"].get("message")))
                    return
                if not any((c.get("logprobs") or {}).get("content") for c in chunk["choices"]):
                    continue  # the role chunk, the usage chunk
                now = time.perf_counter()
                if last is not None:  # the first token's wait is the TTFT, not a gap
                    gaps.append(now - last)
                last = now
    except httpx.HTTPError as exc:
        out.errors.append(f"{type(exc).__name__}: {exc}")
        return
    out.gaps_s += gaps
    out.num_streams_ok += 1


async def background(client: httpx.AsyncClient, rng: random.Random, done: asyncio.Event, out: Round) -> None:
    while not done.is_set():
        try:
            r = await client.post("/v1/chat/completions", json=_body(rng, rng.randint(1, 2), False))
            if r.status_code != 200:
                out.errors.append(f"background HTTP {r.status_code}: {r.text[:200]}")
                await asyncio.sleep(0.05)
            else:
                out.num_background += 1
        except httpx.HTTPError as exc:
            out.errors.append(f"background {type(exc).__name__}: {exc}")
            await asyncio.sleep(0.05)


def run_round(server: Server, args: argparse.Namespace, seed: int, max_tokens: int) -> Round:
    """One round against `server`, noting how busy the rest of the machine was meanwhile."""
    before = _busy_ticks(), _process_ticks(server.proc.pid), _own_ticks()
    out = asyncio.run(_round(server, args, seed, max_tokens))
    after = _busy_ticks(), _process_ticks(server.proc.pid), _own_ticks()
    others = (after[0] - before[0]) - (after[1] - before[1]) - (after[2] - before[2])
    out.others_cores = max(0.0, others / os.sysconf("SC_CLK_TCK") / out.seconds)
    return out


async def _round(server: Server, args: argparse.Namespace, seed: int, max_tokens: int) -> Round:
    rng = random.Random(seed)
    out = Round()
    headers = {"Authorization": f"Bearer {server.api_key}"}
    n = args.streams + args.background
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(
        base_url=server.base_url, headers=headers, timeout=300, limits=limits
    ) as client:
        done = asyncio.Event()
        start = time.perf_counter()
        workers = [
            asyncio.create_task(background(client, random.Random(rng.random()), done, out))
            for _ in range(args.background)
        ]
        await asyncio.sleep(0.3)  # requests are finishing (and being journaled) before streams start
        await asyncio.gather(
            *(long_stream(client, _body(rng, max_tokens, True), out) for _ in range(args.streams))
        )
        done.set()
        await asyncio.gather(*workers)
        out.seconds = time.perf_counter() - start
    return out


def summarize(rounds: list[Round]) -> dict[str, Any]:
    p99s = [percentile(r.gaps_s, 0.99) for r in rounds]
    all_gaps = [g for r in rounds for g in r.gaps_s]
    return {
        "p99_per_round_s": [round(p, 5) if p is not None else None for p in p99s],
        "p50_s": percentile(all_gaps, 0.50),
        "p999_s": percentile(all_gaps, 0.999),
        "max_s": max(all_gaps, default=None),
        "gaps_over_100ms": sum(g > 0.1 for g in all_gaps),
        "num_gaps": len(all_gaps),
        "streams_ok": sum(r.num_streams_ok for r in rounds),
        "background_requests": sum(r.num_background for r in rounds),
        "round_s": [round(r.seconds, 2) for r in rounds],
        "others_cores": [round(r.others_cores, 2) for r in rounds],
        "errors": sorted({e for r in rounds for e in r.errors})[:5],
    }
