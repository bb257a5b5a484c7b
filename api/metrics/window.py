"""A small in-memory ring of recent engine samples for the admin console's charts.

Prometheus keeps history for operators who run one; the console needs the last 15 minutes without
one. Every `interval_s` (2 s) a sample records latency percentiles over a sliding window of the
requests that finished in the last `latency_window_s` (60 s), the engine gauges, and rates computed
from the engine's cumulative counters between samples. Percentiles are nearest-rank over the raw
observations (bounded deques), the same definition `benchmarks/serving.py` reports.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

from base_engine.outputs import EngineStats, RequestOutput

PERCENTILES = (50, 95, 99)
LATENCIES = ("ttft", "itl", "queue", "prefill", "e2e")
_MAX_OBSERVATIONS = 50_000  # per latency; inter-token gaps arrive one per generated token
_TOP_ADAPTERS = 10


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile: the smallest value with at least p% of values <= it."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]


class RecentStats:
    def __init__(
        self,
        *,
        interval_s: float = 2.0,
        window_s: float = 900.0,
        latency_window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if interval_s <= 0 or window_s < interval_s or latency_window_s <= 0:
            raise ValueError(
                f"need 0 < interval_s <= window_s and latency_window_s > 0, got "
                f"{interval_s=}, {window_s=}, {latency_window_s=}"
            )
        self.interval_s = interval_s
        self.window_s = window_s
        self.latency_window_s = latency_window_s
        self.clock = clock
        self.wall_clock = wall_clock
        self._lock = threading.Lock()
        # (monotonic time, value) per latency kind, and finished requests' tokens and adapters.
        self._latencies: dict[str, deque[tuple[float, float]]] = {
            k: deque(maxlen=_MAX_OBSERVATIONS) for k in LATENCIES
        }
        self._tokens: deque[tuple[float, int]] = deque(maxlen=_MAX_OBSERVATIONS)
        self._adapters: deque[tuple[float, str]] = deque(maxlen=_MAX_OBSERVATIONS)
        self._samples: deque[dict[str, float | int | None]] = deque(maxlen=int(window_s / interval_s))
        self._last_sample_at: float | None = None
        self._last_totals: tuple[int, int, int] | None = None  # preemptions, prefix queries, prefix hits

    def observe(self, out: RequestOutput, *, adapter: str | None) -> None:
        """Record a finished request's latencies (called from the engine thread)."""
        now = self.clock()
        m = out.metrics
        with self._lock:
            self._tokens.append((now, out.num_completion_tokens))
            self._adapters.append((now, adapter or "base"))
            if m is None:
                return
            self._latencies["queue"].append((now, m.queue_time_s))
            self._latencies["e2e"].append((now, m.e2e_s))
            if out.num_completion_tokens > 0:
                self._latencies["ttft"].append((now, m.ttft_s))
                self._latencies["prefill"].append((now, m.prefill_time_s))
                self._latencies["itl"].extend((now, v) for v in m.inter_token_s)

    def sample(self, stats: EngineStats) -> bool:
        """Append a sample when `interval_s` has passed since the last one; True when it did."""
        now = self.clock()
        with self._lock:
            if self._last_sample_at is not None and now - self._last_sample_at < self.interval_s:
                return False
            elapsed = None if self._last_sample_at is None else now - self._last_sample_at
            self._last_sample_at = now
            self._prune(now - self.latency_window_s)
            sample: dict[str, float | int | None] = {"t": self.wall_clock()}
            for kind, observations in self._latencies.items():
                values = [v for _, v in observations]
                for p in PERCENTILES:
                    sample[f"{kind}_p{p}"] = percentile(values, p)
            sample.update(self._engine_fields(stats, elapsed))
            sample["generation_tokens_per_s"] = sum(n for _, n in self._tokens) / self.latency_window_s
            sample["requests_per_s"] = len(self._adapters) / self.latency_window_s
            self._samples.append(sample)
            return True

    def _engine_fields(self, stats: EngineStats, elapsed: float | None) -> dict[str, float | int | None]:
        totals = (stats.num_preemptions, stats.num_prefix_queries, stats.num_prefix_hits)
        previous = self._last_totals
        self._last_totals = totals
        fields: dict[str, float | int | None] = {
            "kv_cache_usage": stats.kv_cache_usage,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "preemptions": None,
            "prefix_cache_hit_rate": None,
        }
        # A counter that went down means the engine was replaced: no rate for this interval.
        if previous is None or elapsed is None or any(t < p for t, p in zip(totals, previous, strict=True)):
            return fields
        fields["preemptions"] = totals[0] - previous[0]
        queries = totals[1] - previous[1]
        fields["prefix_cache_hit_rate"] = (totals[2] - previous[2]) / queries if queries else None
        return fields

    def _prune(self, oldest: float) -> None:
        for observations in (*self._latencies.values(), self._tokens, self._adapters):
            while observations and observations[0][0] < oldest:
                observations.popleft()

    def timeseries(self) -> dict[str, object]:
        """Columns for charting: `t` (unix seconds) and one list per series, oldest first.

        A value is None where the window held no observation (e.g. no request finished).
        """
        with self._lock:
            samples = list(self._samples)
            top = Counter(name for _, name in self._adapters).most_common(_TOP_ADAPTERS)
        names = [k for k in samples[0] if k != "t"] if samples else []
        return {
            "interval_s": self.interval_s,
            "window_s": self.window_s,
            "latency_window_s": self.latency_window_s,
            "t": [s["t"] for s in samples],
            "series": {name: [s[name] for s in samples] for name in names},
            "top_adapters": [{"adapter": name, "requests": n} for name, n in top],
        }
