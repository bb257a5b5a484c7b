"""Alarm rules for the Overview page, evaluated on the metrics ring (api/metrics/window.py).

Three alarms, each a pure function of the last minutes of samples so it can be tested alone:
- preemptions rising: the engine preempted requests in the last minute, at least as many as in the
  minute before (the KV cache is too small for the load; vLLM's first sign of overload);
- prefix-cache hit rate dropping sharply: the last minute's mean hit rate fell below
  `(1 - hit_rate_drop)` x the mean of the five minutes before, from a baseline worth protecting;
- goodput under the SLO: fewer than `min_goodput` of the requests judged in the last minute met the
  latency SLO (api/admin/console/goodput.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from api.admin.console.goodput import GoodputSnapshot


@dataclass(frozen=True, slots=True)
class AlarmConfig:
    recent_s: float = 60.0  # "the last minute"
    baseline_s: float = 300.0  # hit-rate baseline: the five minutes before the last minute
    hit_rate_drop: float = 0.5  # relative drop that counts as sharp
    min_baseline_hit_rate: float = 0.2  # below this there is no hit rate worth protecting
    min_goodput: float = 0.9
    min_goodput_requests: int = 5  # judge goodput only on enough requests

    def __post_init__(self) -> None:
        if not 0 < self.hit_rate_drop < 1 or not 0 <= self.min_goodput <= 1:
            raise ValueError(
                f"need 0 < hit_rate_drop < 1 and 0 <= min_goodput <= 1, got {self.hit_rate_drop}, "
                f"{self.min_goodput}"
            )
        if self.recent_s <= 0 or self.baseline_s <= 0 or self.min_goodput_requests < 1:
            raise ValueError(
                f"need recent_s, baseline_s > 0 and min_goodput_requests >= 1, got {self.recent_s}, "
                f"{self.baseline_s}, {self.min_goodput_requests}"
            )


@dataclass(frozen=True, slots=True)
class Alarm:
    kind: str  # "preemptions" | "prefix_cache_hit_rate" | "goodput"
    message: str


Series = Sequence[float | int | None]


def _window(t: Sequence[float], values: Series, start: float, end: float) -> list[float]:
    """Non-null values of samples taken in [start, end)."""
    return [float(v) for ti, v in zip(t, values, strict=True) if start <= ti < end and v is not None]


def preemption_alarm(t: Sequence[float], preemptions: Series, cfg: AlarmConfig) -> Alarm | None:
    if not t:
        return None
    now = t[-1] + 1e-9  # the latest sample belongs to the recent window
    recent = sum(_window(t, preemptions, now - cfg.recent_s, now))
    before = sum(_window(t, preemptions, now - 2 * cfg.recent_s, now - cfg.recent_s))
    if recent > 0 and recent >= before:
        return Alarm(
            "preemptions",
            f"Preemptions rising: {recent:.0f} in the last {cfg.recent_s:.0f} s ({before:.0f} in the "
            f"{cfg.recent_s:.0f} s before): the KV cache is short for this load",
        )
    return None


def hit_rate_alarm(t: Sequence[float], hit_rate: Series, cfg: AlarmConfig) -> Alarm | None:
    if not t:
        return None
    now = t[-1] + 1e-9
    recent = _window(t, hit_rate, now - cfg.recent_s, now)
    baseline = _window(t, hit_rate, now - cfg.recent_s - cfg.baseline_s, now - cfg.recent_s)
    if not recent or not baseline:
        return None
    recent_mean, baseline_mean = sum(recent) / len(recent), sum(baseline) / len(baseline)
    if baseline_mean >= cfg.min_baseline_hit_rate and recent_mean <= baseline_mean * (1 - cfg.hit_rate_drop):
        return Alarm(
            "prefix_cache_hit_rate",
            f"Prefix-cache hit rate dropped sharply: {recent_mean:.0%} in the last {cfg.recent_s:.0f} s, "
            f"was {baseline_mean:.0%}",
        )
    return None


def goodput_alarm(goodput: GoodputSnapshot, cfg: AlarmConfig) -> Alarm | None:
    ratio = goodput.ratio
    if ratio is None or goodput.num_requests < cfg.min_goodput_requests or ratio >= cfg.min_goodput:
        return None
    return Alarm(
        "goodput",
        f"Goodput under SLO: {goodput.num_good} of {goodput.num_requests} recent requests "
        f"({ratio:.0%}) met the latency SLO, target {cfg.min_goodput:.0%}",
    )


def evaluate(timeseries: dict[str, object], goodput: GoodputSnapshot, cfg: AlarmConfig) -> list[Alarm]:
    """All alarms firing now, from `Metrics.timeseries()` and the goodput window."""
    t = timeseries.get("t", [])
    series = timeseries.get("series", {})
    assert isinstance(t, list) and isinstance(series, dict)
    empty: list[None] = [None] * len(t)
    alarms = [
        preemption_alarm(t, series.get("preemptions", empty), cfg),
        hit_rate_alarm(t, series.get("prefix_cache_hit_rate", empty), cfg),
        goodput_alarm(goodput, cfg),
    ]
    return [a for a in alarms if a is not None]
