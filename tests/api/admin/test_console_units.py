"""The console's pure parts: alarm rules, goodput, sessions, date ranges, quota forms.

Oracles: hand-built sample series whose expected verdict follows from the rule's definition (not
from running the code), a fake clock for expiry, and Python's own date arithmetic.
"""

from __future__ import annotations

from datetime import UTC, date, datetime

import pytest

from api.admin.console.alarms import AlarmConfig, evaluate, goodput_alarm, hit_rate_alarm, preemption_alarm
from api.admin.console.core import human_bytes, percent, seconds
from api.admin.console.data import DateRange
from api.admin.console.goodput import GoodputSnapshot, GoodputWindow, Slo
from api.admin.console.service import parse_quotas
from api.admin.console.sessions import SessionStore
from api.errors import APIError
from base_engine.outputs import RequestMetrics, RequestOutput
from registry.types import TenantQuotas

CFG = AlarmConfig()


def every_2s(n: int, start: float = 1_000.0) -> list[float]:
    return [start + 2 * i for i in range(n)]


# ---- alarms ---------------------------------------------------------------------------------------


def test_preemptions_rising_fires_only_when_the_last_minute_has_at_least_the_minute_before() -> None:
    t = every_2s(60)  # two minutes of samples: first 30 = the minute before, last 30 = the last minute
    quiet = [0] * 60
    assert preemption_alarm(t, quiet, CFG) is None
    rising = [0] * 30 + [0] * 25 + [1, 0, 2, 0, 1]
    alarm = preemption_alarm(t, rising, CFG)
    assert alarm is not None and alarm.kind == "preemptions" and "4 in the last 60 s" in alarm.message
    falling = [1] * 30 + [0] * 29 + [1]  # 30 before, 1 now: recovering, no alarm
    assert preemption_alarm(t, falling, CFG) is None
    assert preemption_alarm([], [], CFG) is None


def test_hit_rate_alarm_on_a_sharp_drop_from_a_real_baseline() -> None:
    t = every_2s(180)  # six minutes: five of baseline, one recent
    steady = [0.8] * 180
    assert hit_rate_alarm(t, steady, CFG) is None
    drop = [0.8] * 150 + [0.3] * 30  # 0.3 <= 0.8 * (1 - 0.5)
    alarm = hit_rate_alarm(t, drop, CFG)
    assert alarm is not None and "30%" in alarm.message and "80%" in alarm.message
    mild = [0.8] * 150 + [0.5] * 30  # 0.5 > 0.4: not sharp
    assert hit_rate_alarm(t, mild, CFG) is None
    low_baseline = [0.1] * 150 + [0.0] * 30  # nothing worth protecting
    assert hit_rate_alarm(t, low_baseline, CFG) is None
    no_traffic_recently = [0.8] * 150 + [None] * 30
    assert hit_rate_alarm(t, no_traffic_recently, CFG) is None


def test_goodput_alarm_needs_enough_requests_under_target() -> None:
    assert goodput_alarm(GoodputSnapshot(num_requests=10, num_good=8), CFG) is not None  # 80% < 90%
    assert goodput_alarm(GoodputSnapshot(num_requests=10, num_good=9), CFG) is None
    assert goodput_alarm(GoodputSnapshot(num_requests=4, num_good=0), CFG) is None  # too few to judge
    assert goodput_alarm(GoodputSnapshot(num_requests=0, num_good=0), CFG) is None


def test_evaluate_reads_metrics_timeseries_columns() -> None:
    t = every_2s(60)
    ts = {"t": t, "series": {"preemptions": [None] + [0] * 58 + [3], "prefix_cache_hit_rate": [None] * 60}}
    kinds = [a.kind for a in evaluate(ts, GoodputSnapshot(20, 2), CFG)]
    assert kinds == ["preemptions", "goodput"]
    assert evaluate({"t": [], "series": {}}, GoodputSnapshot(0, 0), CFG) == []


def test_alarm_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="hit_rate_drop"):
        AlarmConfig(hit_rate_drop=1.5)


# ---- goodput --------------------------------------------------------------------------------------


def finished(ttft: float, gaps: list[float], n_tokens: int | None = None) -> RequestOutput:
    n = len(gaps) + 1 if n_tokens is None else n_tokens
    metrics = RequestMetrics(ttft_s=ttft, e2e_s=ttft + sum(gaps), inter_token_s=gaps)
    return RequestOutput("r", [1, 2], list(range(n)), "", finish_reason="length", metrics=metrics)


def test_slo_uses_ttft_and_mean_time_per_output_token() -> None:
    slo = Slo(ttft_s=1.0, tpot_s=0.1)
    assert slo.is_met(finished(0.5, [0.05, 0.15])) is True  # mean gap 0.1
    assert slo.is_met(finished(0.5, [0.05, 0.25])) is False  # mean gap 0.15
    assert slo.is_met(finished(1.5, [0.01])) is False
    assert slo.is_met(finished(0.5, [], n_tokens=0)) is None  # nothing produced: not judged


def test_goodput_window_forgets_old_requests() -> None:
    now = [0.0]
    window = GoodputWindow(Slo(ttft_s=1.0, tpot_s=0.1), window_s=60, clock=lambda: now[0])
    window.observe(finished(2.0, [0.01]))  # bad
    now[0] = 30.0
    window.observe(finished(0.1, [0.01]))  # good
    assert window.snapshot() == GoodputSnapshot(num_requests=2, num_good=1)
    now[0] = 70.0  # the bad one is 70 s old
    snap = window.snapshot()
    assert (snap.num_requests, snap.num_good, snap.ratio) == (1, 1, 1.0)


# ---- sessions -------------------------------------------------------------------------------------


def test_sessions_are_opaque_unique_and_expire_when_idle_or_old() -> None:
    now = [0.0]
    store = SessionStore(idle_s=10, max_age_s=25, clock=lambda: now[0])
    a, b = store.create(), store.create()
    assert a.id != b.id and a.csrf_token != b.csrf_token and len(a.id) >= 43  # 256 bits, base64url
    now[0] = 9.0
    assert store.get(a.id) is a  # touched at 9
    now[0] = 18.0
    assert store.get(a.id) is a and store.get(b.id) is None  # b idle for 18 s > 10
    now[0] = 26.0
    assert store.get(a.id) is None  # older than 25 s though never idle
    assert store.get(None) is None and store.get("made-up") is None


def test_session_store_is_bounded_and_drops_the_oldest() -> None:
    store = SessionStore(max_sessions=2)
    first, second, third = store.create(), store.create(), store.create()
    assert store.get(first.id) is None and store.get(second.id) is second and store.get(third.id) is third
    store.drop(third.id)
    assert store.get(third.id) is None and len(store) == 1


def test_csrf_token_comparison() -> None:
    session = SessionStore().create()
    assert session.csrf_matches(session.csrf_token)
    assert not session.csrf_matches(None) and not session.csrf_matches("") and not session.csrf_matches("x")


# ---- ranges, forms, formatting --------------------------------------------------------------------


def test_date_range_defaults_to_this_month_and_covers_whole_days() -> None:
    r = DateRange.parse(None, None, today=date(2026, 3, 17))
    assert (r.start, r.end) == (date(2026, 3, 1), date(2026, 3, 17))
    assert r.since == datetime(2026, 3, 1, tzinfo=UTC) and r.until == datetime(2026, 3, 18, tzinfo=UTC)
    assert len(r.days()) == 17 and r.days()[0] == "2026-03-01" and r.days()[-1] == "2026-03-17"
    with pytest.raises(ValueError, match="YYYY-MM-DD"):
        DateRange.parse("03/01/2026", None)
    with pytest.raises(ValueError, match="before its start"):
        DateRange.parse("2026-03-02", "2026-03-01")


def test_parse_quotas_blank_is_default_and_garbage_is_named() -> None:
    assert parse_quotas({"rpm": "60", "tpm": " ", "max_concurrent": "0"}) == TenantQuotas(
        rpm=60, max_concurrent=0
    )
    with pytest.raises(APIError, match="quota tpm .* got '-5'"):
        parse_quotas({"tpm": "-5"})


def test_formatting_filters() -> None:
    assert (seconds(None), seconds(0.0123), seconds(1.5)) == ("–", "12 ms", "1.50 s")
    assert (percent(None), percent(0.25)) == ("–", "25.0%")
    assert (human_bytes(512), human_bytes(3 * 1024 * 1024)) == ("512 B", "3.0 MiB")
