"""Small pieces of the API layer without a server: usage rule, seeds, admission bound, secrets."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.context import compute_usage
from api.errors import APIError
from api.inference.sampling import derive_seed
from api.tenancy.admission import Admission
from api.tenancy.keyfiles import read_or_create_secret, replace_secret, tenant_cache_salt
from base_engine.outputs import RequestOutput


def _out(prompt: int, completion: int, cached: int) -> RequestOutput:
    return RequestOutput("r", list(range(prompt)), list(range(completion)), "", num_cached_tokens=cached)


def test_usage_bills_each_prompt_once_and_every_choice() -> None:
    # Two prompts (5 and 7 tokens) x n=2 choices, in choice order p0c0, p0c1, p1c0, p1c1.
    finals = [_out(5, 3, 4), _out(5, 2, 0), _out(7, 1, 0), _out(7, 4, 7)]
    usage = compute_usage(finals, n=2)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (12, 10, 4)
    assert usage.to_dict()["total_tokens"] == 22
    with pytest.raises(ValueError, match="multiple of n=3"):
        compute_usage(finals, n=3)


def test_derived_seeds() -> None:
    assert derive_seed(None, 3) is None
    assert derive_seed(42, 0) == 42
    seeds = [derive_seed(2**64 - 1, i) for i in range(4)]
    assert len(set(seeds)) == 4 and all(s is not None and s < 2**64 for s in seeds)


def test_admission_bound_and_drain() -> None:
    admission = Admission(max_in_flight=3)
    first = admission.acquire(2)
    with pytest.raises(APIError) as info:
        admission.acquire(2)
    assert info.value.status == 503 and info.value.headers["Retry-After"] == "1"
    first.release()
    first.release()  # idempotent
    assert admission.num_in_flight == 0
    with pytest.raises(APIError) as too_big:
        admission.acquire(4)
    assert too_big.value.status == 400
    admission.is_draining = True
    with pytest.raises(APIError) as draining:
        admission.acquire(1)
    assert draining.value.code == "shutting_down"


def test_secrets_are_created_once_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "k"
    value, created = read_or_create_secret(path, lambda: "one")
    assert (value, created) == ("one", True) and path.stat().st_mode & 0o777 == 0o600
    assert read_or_create_secret(path, lambda: "two") == ("one", False)
    replace_secret(path, "three")
    assert path.read_text().strip() == "three" and path.stat().st_mode & 0o777 == 0o600


def test_cache_salt_is_per_tenant_and_per_server() -> None:
    assert tenant_cache_salt("s", "a") == tenant_cache_salt("s", "a")
    assert tenant_cache_salt("s", "a") != tenant_cache_salt("s", "b")
    assert tenant_cache_salt("s", "a") != tenant_cache_salt("t", "a")


def test_503_after_the_quota_check_does_not_consume_the_tenants_limits() -> None:
    """admission.admit: the quota check admits, the server's bound then refuses (503); the tenant's
    rpm/tpm/concurrency must come back whole, so its next request is judged as if this one never came."""
    from api.context import RequestContext
    from api.metering.request_meter import NoMeter
    from api.tenancy.admission import admit
    from api.tenancy.quota_gate import TenantQuotaGate
    from api.tenancy.quotas import QuotaLimiter
    from registry.types import TenantQuotas

    quotas = TenantQuotaGate(QuotaLimiter(TenantQuotas(rpm=1, tpm=50, max_concurrent=1)))
    admission = Admission(max_in_flight=1)
    ctx = RequestContext(
        "r1", "completion", "t1", "tenant", "key", "base", num_prompt_tokens=20, max_new_tokens=30
    )
    busy = admission.acquire(1)  # the server is full
    with pytest.raises(APIError) as info:
        admit(quotas=quotas, admission=admission, meter=NoMeter(), ctx=ctx, num_requests=1)
    assert info.value.status == 503
    busy.release()
    # rpm 1 and tpm 50 still available: the 503 took nothing
    ticket = admit(quotas=quotas, admission=admission, meter=NoMeter(), ctx=ctx, num_requests=1)
    ticket.release(None)
