"""What every reliability case shares: the server environment, the row each case emits (one JSON line on
stdout, collected in ROWS for RELIABILITY.md), auth headers, polling and the usage export reader."""

from __future__ import annotations

import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import httpx

from tests.harness.servers import ADMIN_KEY, Server

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
