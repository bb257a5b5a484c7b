"""QuotaLimiter: 429 decisions with retry-after, OpenAI rate-limit headers, concurrency release."""

from __future__ import annotations

import threading

import pytest

from api.tenancy.quotas import QuotaExceededError, QuotaLimiter, format_duration
from registry.types import TenantQuotas
from tests.harness.clock import FakeClock


def test_requests_per_minute_refuse_with_retry_after_and_other_tenants_pass() -> None:
    clock = FakeClock(100.0)
    limiter = QuotaLimiter(TenantQuotas(rpm=3), clock=clock)
    for _ in range(3):
        limiter.admit("a", None, estimated_tokens=10).release()
    with pytest.raises(QuotaExceededError) as refused:
        limiter.admit("a", None, estimated_tokens=10)
    err = refused.value
    assert err.limit == "rpm" and err.is_retryable
    assert err.retry_after_s == pytest.approx(20.0)  # one request refills every 60/3 s
    assert "requests per minute" in err.message and "limit 3" in err.message
    limiter.admit("b", None, estimated_tokens=10)  # another tenant is unaffected
    clock.now += 19.9
    with pytest.raises(QuotaExceededError):
        limiter.admit("a", None, estimated_tokens=10)
    clock.now += 0.2
    limiter.admit("a", None, estimated_tokens=10)


def test_tenant_quotas_override_defaults_and_none_is_unlimited() -> None:
    limiter = QuotaLimiter(TenantQuotas(rpm=1, tpm=None), clock=FakeClock(100.0))
    assert limiter.limits(TenantQuotas(rpm=5)).rpm == 5
    assert limiter.limits(TenantQuotas()).rpm == 1
    for _ in range(5):
        limiter.admit("big", TenantQuotas(rpm=5), estimated_tokens=10**9)  # no token limit anywhere
    assert limiter.headers("big", TenantQuotas(rpm=5)).keys() == {
        "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"
    }  # fmt: skip
    assert QuotaLimiter().headers("free", None) == {}


def test_tokens_per_minute_estimate_and_release_refund() -> None:
    clock = FakeClock(100.0)
    limiter = QuotaLimiter(clock=clock)
    quotas = TenantQuotas(tpm=1000)
    first = limiter.admit("a", quotas, estimated_tokens=600)
    with pytest.raises(QuotaExceededError) as refused:
        limiter.admit("a", quotas, estimated_tokens=600)
    assert refused.value.limit == "tpm"
    assert refused.value.retry_after_s == pytest.approx(200 * 60 / 1000)  # 200 tokens short at 1000/min
    first.release(actual_tokens=100)  # the estimate over-counted by 500: given back
    first.release(actual_tokens=0)  # a second release changes nothing
    limiter.admit("a", quotas, estimated_tokens=600)
    headers = limiter.headers("a", quotas)
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert headers["x-ratelimit-remaining-tokens"] == "300"  # 1000 - 100 - 600
    assert headers["x-ratelimit-reset-tokens"] == "42s"  # 700 tokens to refill at 1000/min
    with pytest.raises(QuotaExceededError) as never:
        limiter.admit("a", quotas, estimated_tokens=1001)  # larger than the whole limit
    assert not never.value.is_retryable and "1001" in never.value.message


def test_concurrency_limit_and_release() -> None:
    limiter = QuotaLimiter(TenantQuotas(max_concurrent=2), clock=FakeClock(100.0))
    held = [limiter.admit("a", None, estimated_tokens=1) for _ in range(2)]
    with pytest.raises(QuotaExceededError) as refused:
        limiter.admit("a", None, estimated_tokens=1)
    assert refused.value.limit == "max_concurrent" and "limit 2" in refused.value.message
    assert refused.value.retry_after_s > 0
    held[0].release()
    held[0].release()  # idempotent: does not free a second slot
    assert limiter.num_concurrent("a") == 1
    limiter.admit("a", None, estimated_tokens=1)
    with pytest.raises(QuotaExceededError):
        limiter.admit("a", None, estimated_tokens=1)


def test_zero_blocks_the_tenant_and_is_not_retryable() -> None:
    limiter = QuotaLimiter(clock=FakeClock(100.0))
    for quotas, limit in ((TenantQuotas(rpm=0), "rpm"), (TenantQuotas(max_concurrent=0), "max_concurrent")):
        with pytest.raises(QuotaExceededError) as refused:
            limiter.admit("a", quotas, estimated_tokens=1)
        assert refused.value.limit == limit and not refused.value.is_retryable


def test_headers_track_the_request_bucket() -> None:
    clock = FakeClock(100.0)
    limiter = QuotaLimiter(TenantQuotas(rpm=60), clock=clock)
    assert limiter.headers("a", None) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "60",
        "x-ratelimit-reset-requests": "0s",
    }
    for _ in range(6):
        limiter.admit("a", None, estimated_tokens=1)
    headers = limiter.headers("a", None)
    assert headers["x-ratelimit-remaining-requests"] == "54"
    assert headers["x-ratelimit-reset-requests"] == "6s"
    clock.now += 3
    assert limiter.headers("a", None)["x-ratelimit-remaining-requests"] == "57"
    # A lowered limit caps what is left at once.
    assert limiter.headers("a", TenantQuotas(rpm=10))["x-ratelimit-remaining-requests"] == "10"


def test_admission_is_atomic_under_threads() -> None:
    limiter = QuotaLimiter(TenantQuotas(rpm=50), clock=FakeClock(100.0))
    admitted: list[object] = []
    refused: list[QuotaExceededError] = []

    def worker() -> None:
        for _ in range(25):
            try:
                admitted.append(limiter.admit("a", None, estimated_tokens=1))
            except QuotaExceededError as exc:
                refused.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 50 and len(refused) == 50


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (0.02, "20ms"), (0.0004, "1ms"), (1, "1s"), (1.5, "1.5s"), (59.999, "59.999s"), (60, "1m0s"),
     (360, "6m0s"), (90.25, "1m30.25s"), (3723, "1h2m3s")],
)  # fmt: skip
def test_reset_durations_are_written_like_openai(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_refund_gives_back_the_request_and_its_whole_estimate() -> None:
    """A request refused after its quota check (503 overload) never ran: it must not count."""
    limiter = QuotaLimiter(TenantQuotas(rpm=1, tpm=100, max_concurrent=1), clock=FakeClock(100.0))
    admission = limiter.admit("a", None, estimated_tokens=100)
    admission.refund()
    admission.refund()  # once only
    admission.release(0)  # and a later release does nothing either
    assert limiter.num_concurrent("a") == 0
    limiter.admit("a", None, estimated_tokens=100)  # the same rpm, tpm and concurrency again
    with pytest.raises(QuotaExceededError):
        limiter.admit("a", None, estimated_tokens=1)
