"""Usage metering end to end against real `loraserve serve` processes: usage equals what clients received,
each request is metered once (also across a crash), tenants see only their own usage, `/metrics`
parses and moves, quotas refuse with 429, and prefix-cache blocks are shared per tenant only.

Oracles: the `usage` objects and `X-Request-Id`s the clients received, the Prometheus text parser,
and the database read with the registry's own functions after the server is gone.
"""

from __future__ import annotations

import itertools
import random
import signal
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from registry.db import make_engine, session_factory
from registry.usage import UsageRecord, export_usage
from tests.harness.metric_names import REQUIRED_METRIC_NAMES
from tests.harness.servers import ADMIN_KEY, Server, ServerProcess, bearer, main_server_args
from tests.harness.uploads import files_of, peft_adapter, upload
from tests.harness.usage import export
from tests.harness.wait import wait_for

pytestmark = pytest.mark.slow  # real servers

BASE = "tiny-llama"
LONG = {"max_tokens": 200, "ignore_eos": True}


def tokens(usage: dict[str, Any]) -> tuple[int, int, int]:
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"]


def record_tokens(record: dict[str, Any]) -> tuple[int, int, int]:
    return record["prompt_tokens"], record["cached_prompt_tokens"], record["completion_tokens"]


def aborted_stream(base_url: str, key: str, body: dict[str, Any]) -> str:
    """Open a stream, read one event, hang up; returns the request id (the client saw no usage)."""
    url = f"{base_url}/v1/completions"
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=bearer(key), timeout=60) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))
        return r.headers["x-request-id"]


def test_usage_api_equals_what_clients_received(server: Server, tmp_path: Path) -> None:
    tenant_a, key_a = server.tenant("usage-a")
    tenant_b, key_b = server.tenant("usage-b")
    assert upload(server, key_a, "bot", files_of(peft_adapter(tmp_path / "bot", seed=3))).status_code == 201
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key_a, max_retries=0, timeout=120)
    received: dict[str, tuple[str, dict[str, Any]]] = {}  # request id -> (adapter key, usage)

    raw = client.completions.with_raw_response.create(model=BASE, prompt="Hello", max_tokens=6)
    done = raw.parse()
    assert raw.headers["x-request-id"] == done.id
    received[done.id] = ("base", done.usage.model_dump())
    for kwargs in ({"n": 2, "seed": 1}, {"stop": ["a", "e"], "temperature": 1.0}):
        chat = client.chat.completions.create(
            model="bot", messages=[{"role": "user", "content": "Hi there"}], max_tokens=8, **kwargs
        )
        received[chat.id] = ("bot@1", chat.usage.model_dump())
    stream = client.chat.completions.create(
        model="bot@1", messages=[{"role": "user", "content": "Stream"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    received[chunks[-1].id] = ("bot@1", chunks[-1].usage.model_dump())
    aborted = {aborted_stream(server.base_url, key_a, {"model": "bot", "prompt": "Go", **LONG}): "bot@1"}
    with pytest.raises(openai.BadRequestError):  # refused before admission: never billed
        client.completions.create(model=BASE, prompt="x " * 400, max_tokens=10)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    b_usage = httpx.post(
        f"{server.base_url}/v1/completions", json={"model": BASE, "prompt": "B", "max_tokens": 3},
        headers=bearer(key_b), timeout=60,
    ).json()["usage"]  # fmt: skip

    wait_for(
        lambda: set(aborted) <= {r["request_id"] for r in export(server.base_url, tenant_a)},
        30.0,
        interval=0.1,
        what="abort",
    )
    records = export(server.base_url, tenant_a)
    ids = [r["request_id"] for r in records]
    assert Counter(ids).most_common(1)[0][1] == 1 and set(ids) == set(received) | set(aborted)
    by_id = {r["request_id"]: r for r in records}
    for rid, (_, usage) in received.items():  # the record is the response's usage, to the token
        assert record_tokens(by_id[rid]) == tokens(usage)
    assert {by_id[rid]["finish_reason"] for rid in aborted} == {"abort"}

    expected: dict[str, list[int]] = {}
    billed = [(k, tokens(u)) for k, u in received.values()] + [
        (k, record_tokens(by_id[rid])) for rid, k in aborted.items()
    ]
    for key, triple in billed:
        totals = expected.setdefault(key, [0, 0, 0, 0])
        for i, value in enumerate((1, *triple)):
            totals[i] += value
    mine = httpx.get(f"{server.base_url}/v1/usage?group_by=adapter", headers=bearer(key_a)).json()["data"]
    fields = ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens")
    assert {g["key"]: [g[f] for f in fields] for g in mine} == expected
    by_day = httpx.get(f"{server.base_url}/v1/usage", headers=bearer(key_a)).json()["data"]
    assert [sum(g[f] for g in by_day) for f in fields] == [
        sum(t[i] for t in expected.values()) for i in range(4)
    ]

    # Tenant B sees its one request only, whatever it asks for.
    theirs = httpx.get(f"{server.base_url}/v1/usage?tenant_id={tenant_a}", headers=bearer(key_b)).json()[
        "data"
    ]
    assert [[g[f] for f in fields] for g in theirs] == [[1, *tokens(b_usage)]]
    admin = httpx.get(
        f"{server.base_url}/admin/api/usage",
        params={"group_by": "tenant", "format": "csv"},
        headers=bearer(ADMIN_KEY),
    )
    assert admin.headers["content-type"].startswith("text/csv")
    rows = {line.split(",")[0]: line.split(",")[1:] for line in admin.text.splitlines()[1:]}
    assert rows[tenant_b] == [str(v) for v in (1, *tokens(b_usage))]


def metric_values(base_url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    # With a key (the admin key also serves as metrics token): the per-tenant series are included.
    r = httpx.get(f"{base_url}/metrics", headers=bearer(ADMIN_KEY), timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = list(text_string_to_metric_families(r.text))
    assert {f.name for f in families} >= set(REQUIRED_METRIC_NAMES)
    return {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}


def test_metrics_parse_and_move(server: Server) -> None:
    name = f"metrics-{random.randrange(10**9)}"
    tenant = httpx.post(
        f"{server.base_url}/admin/api/tenants", json={"name": name}, headers=bearer(ADMIN_KEY)
    ).json()
    running = ("vllm:num_requests_running", frozenset({("model_name", BASE), ("engine", "0")}))
    generated = ("vllm:generation_tokens_total", frozenset({("model_name", BASE), ("engine", "0")}))
    before = metric_values(server.base_url)
    url = f"{server.base_url}/v1/completions"
    body = {"model": BASE, "prompt": "Count", "stream": True, **LONG}
    with httpx.stream("POST", url, json=body, headers=bearer(tenant["api_key"]), timeout=120) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert metric_values(server.base_url)[running] >= 1  # running while the stream is open
        for _ in lines:
            pass
    wait_for(lambda: metric_values(server.base_url)[running] == 0, 30.0, what="running back to 0")
    after = metric_values(server.base_url)
    assert after[generated] - before[generated] >= 200
    assert after[("loraserve_tenant_requests_total", frozenset({("tenant", name)}))] == 1
    assert after[("loraserve_tenant_generation_tokens_total", frozenset({("tenant", name)}))] == 200


def test_quotas_refuse_with_429_and_others_are_unaffected(server: Server) -> None:
    limited, key = server.tenant("quota")
    other_key = server.tenant("quota-other")[1]
    assert server.admin("PUT", f"/tenants/{limited}/quotas", json={"rpm": 2}).status_code == 200
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=60)
    for remaining in ("1", "0"):
        raw = client.completions.with_raw_response.create(model=BASE, prompt="q", max_tokens=1)
        assert raw.headers["x-ratelimit-limit-requests"] == "2"
        assert raw.headers["x-ratelimit-remaining-requests"] == remaining
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(model=BASE, prompt="q", max_tokens=1)
    response = refused.value.response
    assert 1 <= int(response.headers["retry-after"]) <= 30
    error = response.json()["error"]
    assert (
        error["code"] == "rate_limit_exceeded" and error["param"] == "rpm" and "limit 2" in error["message"]
    )
    refused_id = response.headers["x-request-id"]
    body = {"model": BASE, "prompt": "q", "max_tokens": 1}
    ok = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=bearer(other_key), timeout=60)
    assert ok.status_code == 200  # other tenants unaffected
    assert refused_id not in {r["request_id"] for r in export(server.base_url, limited)}  # 429 is not billed

    assert server.admin("PUT", f"/tenants/{limited}/quotas", json={"max_concurrent": 1}).status_code == 200
    url = f"{server.base_url}/v1/completions"
    barrier, statuses = threading.Barrier(6), []

    def send() -> None:
        barrier.wait()
        r = httpx.post(url, json={**body, **LONG}, headers=bearer(key), timeout=60)
        statuses.append((r.status_code, r.json()["error"]["param"] if r.status_code != 200 else None))

    threads = [threading.Thread(target=send) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (200, None) in statuses and (429, "max_concurrent") in statuses, statuses
    assert httpx.post(url, json=body, headers=bearer(key), timeout=60).status_code == 200  # released


def test_prefix_cache_is_shared_within_a_tenant_only(server: Server) -> None:
    prompt = [random.randrange(3, 500) for _ in range(40)]  # 2 full 16-token blocks, never seen before
    key_a, key_b = server.tenant("prefix-a")[1], server.tenant("prefix-b")[1]

    def cached(key: str) -> int:
        body = {"model": BASE, "prompt": prompt, "max_tokens": 1}
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=bearer(key), timeout=60)
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached(key_a) == 0
    assert cached(key_a) >= 32
    assert cached(key_b) == 0  # same prompt, another tenant: its salt makes other blocks
    assert cached(key_b) >= 32


def test_crash_during_load_keeps_every_completed_record_once(tiny_llama_dir: Path, tmp_path: Path) -> None:
    env = {"LORASERVE_ADMIN_KEY": ADMIN_KEY, "LORASERVE_USAGE_FLUSH_INTERVAL_S": "3600"}  # journal only
    process = ServerProcess(main_server_args(tiny_llama_dir), tmp_path / "data", env=env).start()
    tenant = httpx.post(
        f"{process.base_url}/admin/api/tenants", json={"name": "load"}, headers=bearer(ADMIN_KEY)
    ).json()
    completed: dict[str, dict[str, Any]] = {}
    sent: dict[str, int] = {}  # response id -> max_tokens, of every request sent (named by X-Request-Id)
    stop = threading.Event()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for n in itertools.count():
            if stop.is_set():
                return
            body = {"model": BASE, "prompt": "w" * rng.randint(1, 30), "max_tokens": rng.randint(1, 40)}
            sent[f"cmpl-w{seed}-{n}"] = body["max_tokens"]
            try:
                r = httpx.post(
                    f"{process.base_url}/v1/completions",
                    json=body,
                    headers={**bearer(tenant["api_key"]), "X-Request-Id": f"w{seed}-{n}"},
                    timeout=60,
                )
            except httpx.HTTPError:
                return
            completed[r.json()["id"]] = r.json()["usage"]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: len(completed) >= 12, 120, what="12 completed requests")
    process.stop(signal.SIGKILL)  # mid-load: requests in flight, nothing flushed to the database
    stop.set()
    for t in threads:
        t.join()
    assert completed

    process.start()  # replays the journal
    records = {r["request_id"]: r for r in export(process.base_url, tenant["id"])}
    assert len(records) == len(export(process.base_url, tenant["id"]))  # each id once
    for rid, usage in completed.items():
        assert record_tokens(records[rid]) == tokens(usage)
    assert set(records) <= set(sent)  # nothing billed that was not sent
    for rid in set(records) - set(completed):  # no answer reached the client before the crash:
        record = records[rid]
        if record["finish_reason"] == "abort":  # in flight: a non-streaming request handed out nothing
            assert record["completion_tokens"] == 0, record
        else:  # finished and journaled, its response lost with the process: billed in full, once
            assert record["finish_reason"] in ("length", "stop"), record
            expected = sent[rid] if record["finish_reason"] == "length" else record["completion_tokens"]
            assert 1 <= record["completion_tokens"] == expected <= sent[rid], record
    last = httpx.post(
        f"{process.base_url}/v1/completions", json={"model": BASE, "prompt": "end", "max_tokens": 2},
        headers=bearer(tenant["api_key"]), timeout=60,
    ).json()  # fmt: skip
    assert process.stop() == 0  # SIGTERM: drained and flushed
    engine = make_engine(f"sqlite:///{tmp_path / 'data' / 'loraserve.db'}")
    with session_factory(engine)() as session:
        stored: list[UsageRecord] = export_usage(session, tenant_id=tenant["id"], limit=10_000).records
    engine.dispose()
    assert len(stored) == len(records) + 1 and {r.request_id for r in stored} == set(records) | {last["id"]}
