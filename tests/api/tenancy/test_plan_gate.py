"""api/tenancy/plan_gate.py: one tenant's requests are planned (tokenized) at most `per_tenant` at a time,
others'
go on meanwhile, and nothing is kept or leaked per tenant. Then in process on the real app: a burst of
slow-to-tokenize prompts from one tenant never has more than the bound on the tokenizer at once."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.state import AppState
from api.tenancy.plan_gate import PlanGate
from tests.api.admin import console_helpers as ch

SLOW = "SLOW-TO-TOKENIZE "


def test_one_tenant_waits_for_its_own_slots_only() -> None:
    async def main() -> None:
        gate = PlanGate(per_tenant=2)
        running: dict[str, int] = defaultdict(int)
        peak: dict[str, int] = defaultdict(int)
        b_saw_a_waiting: list[int] = []

        async def plan(tenant: str, hold_s: float) -> None:
            async with gate.slot(tenant):
                running[tenant] += 1
                peak[tenant] = max(peak[tenant], running[tenant])
                if tenant == "b":
                    b_saw_a_waiting.append(len(gate._tenants["a"].waiting))
                await asyncio.sleep(hold_s)
                running[tenant] -= 1

        a_tasks = [asyncio.create_task(plan("a", 0.05)) for _ in range(10)]
        await asyncio.sleep(0.01)
        await plan("b", 0)  # not behind a's queue
        await asyncio.gather(*a_tasks)
        assert (peak["a"], peak["b"]) == (2, 1) and b_saw_a_waiting == [8]
        assert gate.num_tenants() == 0

        holder = asyncio.create_task(plan("c", 0.2))
        waiters = [asyncio.create_task(plan("c", 0)) for _ in range(3)]
        await asyncio.sleep(0.01)
        for waiter in waiters[1:]:  # clients that left while waiting: their places are given up
            waiter.cancel()
        await asyncio.gather(holder, waiters[0])
        await asyncio.gather(*waiters[1:], return_exceptions=True)
        assert gate.num_tenants() == 0

    asyncio.run(main())
    with pytest.raises(ValueError, match="per_tenant"):
        PlanGate(per_tenant=0)


def test_a_burst_of_slow_prompts_takes_at_most_the_bound_of_planning_threads(
    app_state: tuple[FastAPI, AppState], monkeypatch: Any
) -> None:
    app, state = app_state
    bound = state.settings.max_concurrent_plans_per_tenant
    client = TestClient(app, base_url=ch.BASE_URL, raise_server_exceptions=False)
    keys = [
        ch.admin_api(app, "POST", "/tenants", json={"name": ch.new_tenant_name()})["api_key"]
        for _ in range(2)
    ]
    lock, tokenizing, peak = threading.Lock(), [0], [0]
    real_encode = state.tokenizer.encode

    def encode(text: Any, *args: Any, **kwargs: Any) -> Any:
        if not (isinstance(text, str) and text.startswith(SLOW)):
            return real_encode(text, *args, **kwargs)
        with lock:
            tokenizing[0] += 1
            peak[0] = max(peak[0], tokenizing[0])
        time.sleep(0.5)  # a long prompt's tokenization
        with lock:
            tokenizing[0] -= 1
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(state.tokenizer, "encode", encode)
    statuses: list[int] = []

    def complete(key: str, prompt: str, path: str = "/v1/completions") -> None:
        body = {"model": state.model_name, "prompt": prompt}
        if path == "/v1/completions":
            body["max_tokens"] = 1
        r = client.post(path, json=body, headers={"Authorization": f"Bearer {key}"})
        statuses.append(r.status_code)

    paths = ["/v1/completions", "/tokenize"]  # both plan under the same bound
    burst = [
        threading.Thread(target=complete, args=(keys[0], f"{SLOW}{i}", paths[i % 2]))
        for i in range(3 * bound)
    ]
    for thread in burst:
        thread.start()
    complete(keys[1], "another tenant's request")  # not queued behind the burst
    for thread in burst:
        thread.join(60)
    assert statuses == [200] * (3 * bound + 1)
    assert peak[0] == bound, peak  # never more than the bound at once, and the bound was reached
