"""The Overview page's data: eight live numbers, their last 15 minutes, adapter residency, alarms.

The eight numbers are the ones that explain an incident (../shared/reference/platform.md, section 2):
four timers at p50/p95/p99 over the last minute (time to first token, inter-token latency, queue
time, prefill time), and four engine gauges (KV cache usage, requests waiting, preemptions,
prefix-cache hit rate). Timers and rates come from the metrics ring (`Metrics.timeseries()`,
sampled every 2 s); the gauges are read live from the engine, so the page moves even between samples.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from api.admin.console.alarms import AlarmConfig, evaluate
from api.admin.console.core import ConsoleServices
from api.admin.console.goodput import GoodputWindow
from api.metrics.prometheus import Metrics
from base_engine.outputs import EngineStats
from registry.disk_cache import DiskTier

TIMERS = ("ttft", "itl", "queue", "prefill")
PERCENTILES = ("p50", "p95", "p99")
GAUGES = ("kv_cache_usage", "num_waiting", "preemptions", "prefix_cache_hit_rate")


def _timeseries(metrics: Metrics | None) -> dict[str, Any]:
    if metrics is None:  # a server built without the metrics ring: live gauges only
        return {"t": [], "series": {}, "interval_s": None, "window_s": None}
    return dict(metrics.timeseries())


def _latest(values: list[Any]) -> Any:
    return values[-1] if values else None


def live_numbers(stats: EngineStats, ts: dict[str, Any]) -> dict[str, Any]:
    series = ts.get("series", {})
    numbers: dict[str, Any] = {
        timer: {p: _latest(series.get(f"{timer}_{p}", [])) for p in PERCENTILES} for timer in TIMERS
    }
    recent_preemptions = sum(v for v in series.get("preemptions", [])[-30:] if v is not None)
    cumulative_hit_rate = (
        stats.num_prefix_hits / stats.num_prefix_queries if stats.num_prefix_queries else None
    )
    hit_rates = [v for v in series.get("prefix_cache_hit_rate", []) if v is not None]
    numbers |= {
        "kv_cache_usage": stats.kv_cache_usage,
        "num_waiting": stats.num_waiting,
        "num_running": stats.num_running,
        "preemptions": stats.num_preemptions,
        "preemptions_recent": recent_preemptions,
        # The latest interval's rate when there was traffic, else the engine's lifetime rate.
        "prefix_cache_hit_rate": hit_rates[-1] if hit_rates else cumulative_hit_rate,
    }
    return numbers


def residency(stats: EngineStats, *, disk: DiskTier, max_cpu_loras: int) -> dict[str, Any]:
    a = stats.adapters
    return {
        "gpu": {"used": a.num_gpu, "total": a.num_slots, "pinned": len(a.pinned)},
        "cpu": {"used": a.num_cpu, "total": max_cpu_loras},
        "disk": {"used": len(disk.entries()), "bytes": disk.num_bytes, "max_bytes": disk.max_bytes},
    }


def overview(services: ConsoleServices, goodput: GoodputWindow, alarm_config: AlarmConfig) -> dict[str, Any]:
    """Everything the Overview page shows, as JSON for its refresh loop: the engine's stats and
    admission counts, the metrics ring, the disk tier (all from `services`), goodput and alarms."""
    stats = services.engine.stats()
    ts = _timeseries(services.metrics)
    good = goodput.snapshot()
    return {
        "now": time.time(),
        "numbers": live_numbers(stats, ts),
        "t": ts.get("t", []),
        "series": ts.get("series", {}),
        "interval_s": ts.get("interval_s"),
        "window_s": ts.get("window_s"),
        "residency": residency(stats, disk=services.disk, max_cpu_loras=services.max_cpu_loras),
        "goodput": {
            "ratio": good.ratio,
            "num_requests": good.num_requests,
            "num_good": good.num_good,
            "slo_ttft_s": goodput.slo.ttft_s,
            "slo_tpot_s": goodput.slo.tpot_s,
        },
        "alarms": [asdict(a) for a in evaluate(ts, good, alarm_config)],
        "engine": {
            "num_running": stats.num_running,
            "num_kv_blocks_used": stats.num_kv_blocks_used,
            "num_kv_blocks_total": stats.num_kv_blocks_total,
            "num_in_flight": services.admission.num_in_flight,
        },
    }
