"""A tenant already over its rate limits is refused before its request is planned (api/tenancy/quotas.py
`precheck`, called by name before planning): its prompts are never tokenized, its refusal is the 429 that
admission would give, with the OpenAI rate-limit headers. In process on the real app."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.state import AppState
from api.tenancy.quotas import QuotaExceededError, QuotaLimiter
from registry.types import TenantQuotas
from tests.api.admin import console_helpers as ch

PROMPT = "a prompt the tokenizer should see only when the request can be admitted"


def test_precheck_takes_nothing_and_refuses_what_admit_would() -> None:
    now = [100.0]
    limiter = QuotaLimiter(TenantQuotas(rpm=2, max_concurrent=1), clock=lambda: now[0])
    for _ in range(3):
        limiter.precheck("a", None)  # takes nothing: three pre-checks, still two requests left
    held = limiter.admit("a", None, estimated_tokens=5)
    with pytest.raises(QuotaExceededError) as busy:
        limiter.precheck("a", None)
    assert (
        busy.value.limit == "max_concurrent" and busy.value.headers["x-ratelimit-remaining-requests"] == "1"
    )
    held.release()
    limiter.admit("a", None, estimated_tokens=5).release()
    with pytest.raises(QuotaExceededError) as rpm:
        limiter.precheck("a", None)
    assert rpm.value.limit == "rpm" and rpm.value.retry_after_s == pytest.approx(30.0)
    limiter.precheck("b", None)  # another tenant is unaffected
    now[0] += 30.0
    limiter.precheck("a", None)
    tokens = QuotaLimiter(TenantQuotas(tpm=100), clock=lambda: now[0])
    tokens.admit("t", None, estimated_tokens=100).release(actual_tokens=100)
    with pytest.raises(QuotaExceededError) as tpm:
        tokens.precheck("t", None)
    assert tpm.value.limit == "tpm"


def test_a_tenant_over_its_limit_is_refused_before_its_prompt_is_tokenized(
    app_state: tuple[FastAPI, AppState], monkeypatch: Any
) -> None:
    app, state = app_state
    client = TestClient(app, base_url=ch.BASE_URL, raise_server_exceptions=False)
    tenant = ch.admin_api(app, "POST", "/tenants", json={"name": ch.new_tenant_name()})
    quotas = {"rpm": 2, "tpm": None, "max_concurrent": None, "max_adapters": None, "max_adapter_bytes": None}
    assert ch.admin_api(app, "PUT", f"/tenants/{tenant['id']}/quotas", json=quotas)["quotas"] == quotas
    seen: list[str] = []
    real_encode = state.tokenizer.encode

    def encode(text: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(text)
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(state.tokenizer, "encode", encode)
    auth = {"Authorization": f"Bearer {tenant['api_key']}"}
    body = {"model": state.model_name, "prompt": PROMPT, "max_tokens": 1}
    for _ in range(2):
        assert client.post("/v1/completions", json=body, headers=auth).status_code == 200
    assert seen.count(PROMPT) == 2
    refused = client.post("/v1/completions", json=body, headers=auth)
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("rate_limit_exceeded", "rpm")
    assert refused.headers["x-request-id"].startswith("cmpl-")
    assert (
        refused.headers["x-ratelimit-remaining-requests"] == "0" and int(refused.headers["retry-after"]) >= 1
    )
    assert seen.count(PROMPT) == 2  # never tokenized
