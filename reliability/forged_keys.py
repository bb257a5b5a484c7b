"""Forged keys with large bodies: 30 concurrent 4.4 MB JSON bodies with a forged tenant key while
`/health` is polled; the bodies must all be refused (401, or the connection closed after it) and
`/health` must stay fast (before keys were checked ahead of the body, it took 2.9-4.7 s)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx

from reliability.common import BASE, percentile
from tests.harness.servers import Server

NUM_BODIES = 30
FORGED = "lsk-0123456789ab-" + "f" * 43


def _body() -> bytes:
    """4.4 MB of JSON that is costly to parse: a prompt of ~1.5 million token ids."""
    return json.dumps({"model": BASE, "prompt": [1] * 1_470_000, "max_tokens": 1}).encode()


def _poll_health(server: Server, stop: threading.Event, latencies: list[float]) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            start = time.monotonic()
            client.get(f"{server.base_url}/health")
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)


def _send(server: Server, body: bytes, outcomes: list[str]) -> None:
    headers = {"Authorization": f"Bearer {FORGED}", "Content-Type": "application/json"}
    try:
        r = httpx.post(f"{server.base_url}/v1/completions", content=body, headers=headers, timeout=120)
        outcomes.append(str(r.status_code))
    except httpx.TransportError:  # refused and closed while the body was still being sent
        outcomes.append("closed")


def _health_during(server: Server, body: bytes) -> tuple[list[float], list[str]]:
    stop = threading.Event()
    latencies: list[float] = []
    outcomes: list[str] = []
    poller = threading.Thread(target=_poll_health, args=(server, stop, latencies))
    poller.start()
    time.sleep(0.5)
    senders = [threading.Thread(target=_send, args=(server, body, outcomes)) for _ in range(NUM_BODIES)]
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    time.sleep(0.5)
    stop.set()
    poller.join()
    return latencies, outcomes


def case_forged_key_bodies(server: Server) -> tuple[dict[str, Any], list[str]]:
    body = _body()
    baseline: list[float] = []
    stop = threading.Event()
    threading.Timer(2.0, stop.set).start()
    _poll_health(server, stop, baseline)
    latencies, outcomes = _health_during(server, body)
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome] = counts.get(outcome, 0) + 1
    return {
        "bodies": NUM_BODIES,
        "body_mb": round(len(body) / 1e6, 1),
        "outcomes": counts,
        "accepted": sum(n for o, n in counts.items() if o not in ("401", "closed")),
        "health_p50_s_before": round(percentile(baseline, 50), 3),
        "health_p50_s": round(percentile(latencies, 50), 3),
        "health_max_s": round(max(latencies), 3),
        "health_over_1s": sum(t > 1.0 for t in latencies),
    }, ["accepted", "health_over_1s"]
