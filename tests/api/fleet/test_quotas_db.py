"""The fleet's quota backend (api/tenancy/quotas_db.py) decides exactly as the in-memory one
(api/tenancy/quotas.py).

Same scenarios on "memory", "sqlite" and "postgresql" (a real throwaway cluster), plus a differential
run: one seeded random sequence of admissions, releases, refunds and clock steps gives the same
decisions, retry-afters and `x-ratelimit-*` headers on every backend. Then what only the database
backend has: one limit shared by two limiters (two replicas), leases that expire unless renewed, and
a database outage that refuses with 503 instead of admitting unlimited.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import pytest

from api.errors import APIError
from api.tenancy.quotas import Admission, QuotaExceededError, QuotaLimiter
from api.tenancy.quotas_db import DbQuotaLimiter
from migrations.api import upgrade
from registry.db import make_engine, session_factory
from registry.types import TenantQuotas
from tests.harness.clock import FakeClock

MakeLimiter = Callable[..., QuotaLimiter]


@pytest.fixture(params=["memory", "sqlite", "postgresql"])
def make_limiter(request: pytest.FixtureRequest, tmp_path) -> Iterator[MakeLimiter]:  # noqa: ANN001
    """limiter(defaults, clock, **kw) on one backend; database limiters share one migrated database."""
    made: list[DbQuotaLimiter] = []
    if request.param == "memory":
        yield lambda defaults=None, clock=None, **kw: QuotaLimiter(defaults, clock=clock or FakeClock())
        return
    url = (
        f"sqlite:///{tmp_path / 'q.db'}"
        if request.param == "sqlite"
        else request.getfixturevalue("postgres_db_url")
    )
    upgrade(url)
    engine = make_engine(url)
    sessions = session_factory(engine)

    def make(
        defaults: TenantQuotas | None = None, clock: FakeClock | None = None, **kw: object
    ) -> QuotaLimiter:
        limiter = DbQuotaLimiter(sessions, defaults, clock=clock or FakeClock(), **kw)  # type: ignore[arg-type]
        made.append(limiter)
        return limiter

    try:
        yield make
    finally:
        for limiter in made:
            limiter.stop()
        engine.dispose()


def test_rpm_refuses_with_retry_after_refills_and_spares_other_tenants(make_limiter: MakeLimiter) -> None:
    clock = FakeClock()
    limiter = make_limiter(TenantQuotas(rpm=3), clock)
    for _ in range(3):
        limiter.admit("a", None, estimated_tokens=10).release()
    with pytest.raises(QuotaExceededError) as refused:
        limiter.admit("a", None, estimated_tokens=10)
    assert refused.value.limit == "rpm" and refused.value.is_retryable
    assert refused.value.retry_after_s == pytest.approx(20.0)
    assert refused.value.headers["x-ratelimit-remaining-requests"] == "0"
    limiter.admit("b", None, estimated_tokens=10)
    clock.now += 19.9
    with pytest.raises(QuotaExceededError):
        limiter.admit("a", None, estimated_tokens=10)
    clock.now += 0.2
    assert limiter.admit("a", None, estimated_tokens=10).headers["x-ratelimit-limit-requests"] == "3"


def test_tpm_release_refunds_the_estimate_and_headers_say_so(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter(None, FakeClock())
    quotas = TenantQuotas(tpm=1000)
    first = limiter.admit("a", quotas, estimated_tokens=600)
    with pytest.raises(QuotaExceededError) as refused:
        limiter.admit("a", quotas, estimated_tokens=600)
    assert refused.value.limit == "tpm" and refused.value.retry_after_s == pytest.approx(12.0)
    first.release(actual_tokens=100)
    first.release(actual_tokens=0)  # once only
    admitted = limiter.admit("a", quotas, estimated_tokens=600)
    assert admitted.headers["x-ratelimit-remaining-tokens"] == "300"  # 1000 - 100 - 600
    assert admitted.headers["x-ratelimit-reset-tokens"] == "42s"
    assert limiter.headers("a", quotas)["x-ratelimit-remaining-tokens"] == "300"
    with pytest.raises(QuotaExceededError) as never:
        limiter.admit("a", quotas, estimated_tokens=1001)
    assert not never.value.is_retryable


def test_concurrency_refund_and_zero_limits(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter(TenantQuotas(max_concurrent=2), FakeClock())
    held = [limiter.admit("a", None, estimated_tokens=1) for _ in range(2)]
    with pytest.raises(QuotaExceededError) as refused:
        limiter.admit("a", None, estimated_tokens=1)
    assert refused.value.limit == "max_concurrent" and "limit 2" in refused.value.message
    held[0].release()
    held[0].release()
    assert limiter.num_concurrent("a") == 1
    strict = TenantQuotas(rpm=1, tpm=100, max_concurrent=1)
    refunded = limiter.admit("r", strict, estimated_tokens=100)
    refunded.refund()
    limiter.admit("r", strict, estimated_tokens=100)  # the request, tokens and slot came back
    for quotas, limit in ((TenantQuotas(rpm=0), "rpm"), (TenantQuotas(max_concurrent=0), "max_concurrent")):
        with pytest.raises(QuotaExceededError) as zero:
            limiter.admit("z", quotas, estimated_tokens=1)
        assert zero.value.limit == limit and not zero.value.is_retryable


def _trace(limiter: QuotaLimiter, clock: FakeClock, seed: int) -> list[object]:
    """What a seeded random workload sees: every decision, retry-after and header."""
    rng = random.Random(seed)
    quotas = [TenantQuotas(rpm=5, tpm=400, max_concurrent=3), TenantQuotas(rpm=2), TenantQuotas(tpm=50)]
    held: list[Admission] = []
    seen: list[object] = []
    for _ in range(120):
        op = rng.random()
        if op < 0.55:
            tenant = rng.randrange(3)
            try:
                admission = limiter.admit(
                    f"t{tenant}", quotas[tenant], estimated_tokens=rng.randrange(0, 120)
                )
                held.append(admission)
                seen.append(("ok", sorted(admission.headers.items())))
            except QuotaExceededError as exc:
                seen.append(
                    (exc.limit, round(exc.retry_after_s, 6), exc.is_retryable, sorted(exc.headers.items()))
                )
        elif op < 0.8 and held:
            admission = held.pop(rng.randrange(len(held)))
            admission.release(rng.choice([None, rng.randrange(0, 150)]))
        elif op < 0.85 and held:
            held.pop(rng.randrange(len(held))).refund()
        else:
            clock.now += rng.choice([0.5, 3.0, 11.0, 40.0])
    return seen


def test_random_workload_decides_exactly_as_in_memory(make_limiter: MakeLimiter) -> None:
    expected = _trace(QuotaLimiter(clock=(memory_clock := FakeClock())), memory_clock, seed=7)
    clock = FakeClock()
    assert _trace(make_limiter(None, clock), clock, seed=7) == expected


@pytest.fixture
def pg_sessions(postgres_db_url: str) -> Iterator[object]:
    upgrade(postgres_db_url)
    engine = make_engine(postgres_db_url)
    yield session_factory(engine)
    engine.dispose()


def test_two_replicas_share_one_limit_and_dead_leases_expire(pg_sessions) -> None:  # noqa: ANN001
    clock = FakeClock()
    a = DbQuotaLimiter(pg_sessions, holder="a", clock=clock, lease_ttl_s=30, renew_every_s=3600)
    b = DbQuotaLimiter(pg_sessions, holder="b", clock=clock, lease_ttl_s=30, renew_every_s=3600)
    try:
        rpm = TenantQuotas(rpm=4)
        for limiter in (a, b, a, b):
            limiter.admit("r", rpm, estimated_tokens=1).release()
        for limiter in (a, b):  # 4 per minute for the tenant, not 4 per replica
            with pytest.raises(QuotaExceededError) as refused:
                limiter.admit("r", rpm, estimated_tokens=1)
            assert refused.value.limit == "rpm"

        conc = TenantQuotas(max_concurrent=2)
        a.admit("c", conc, estimated_tokens=1)  # a then "dies" with this slot: never released
        b.admit("c", conc, estimated_tokens=1).release()
        held = b.admit("c", conc, estimated_tokens=1)
        with pytest.raises(QuotaExceededError) as busy:
            a.admit("c", conc, estimated_tokens=1)
        assert busy.value.limit == "max_concurrent"
        held.release()
        clock.now += 20
        b._renew()  # b renews what b holds; a's lease is nobody's to renew
        clock.now += 11  # past a's lease expiry: its slot is back without a's help
        second = [b.admit("c", conc, estimated_tokens=1) for _ in range(2)]
        with pytest.raises(QuotaExceededError):
            b.admit("c", conc, estimated_tokens=1)
        assert b.num_concurrent("c") == len(second)
    finally:
        a.stop()
        b.stop()


def test_renewed_leases_outlive_their_ttl(pg_sessions) -> None:  # noqa: ANN001
    clock = FakeClock()
    limiter = DbQuotaLimiter(pg_sessions, holder="r", clock=clock, lease_ttl_s=30, renew_every_s=3600)
    try:
        limiter.admit("t", TenantQuotas(max_concurrent=1), estimated_tokens=1)
        for _ in range(4):
            clock.now += 20
            limiter._renew()
        assert limiter.num_concurrent("t") == 1  # 80 s later, still held
        with pytest.raises(QuotaExceededError):
            limiter.admit("t", TenantQuotas(max_concurrent=1), estimated_tokens=1)
    finally:
        limiter.stop()


def test_database_outage_refuses_with_503_never_unlimited(tmp_path) -> None:  # noqa: ANN001
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    engine = make_engine(f"postgresql+psycopg://postgres@127.0.0.1:{port}/none", timeout_s=2)
    limiter = DbQuotaLimiter(session_factory(engine), TenantQuotas(rpm=10))
    try:
        with pytest.raises(APIError) as refused:
            limiter.admit("t", None, estimated_tokens=1)
        assert refused.value.status == 503 and refused.value.code == "database_unavailable"
        assert refused.value.headers["Retry-After"]
    finally:
        limiter.stop()
        engine.dispose()
