"""A client's `X-Request-Id` (api/inference/client_id.py) against a real server, with the official
`openai` client's `extra_headers`, on both backends (PostgreSQL holds the per-tenant unique key of
migration 0009 that `write_usage`'s ON CONFLICT names): the id names the response and its usage
record; a malformed one is a 400; one its tenant has in flight, or already billed, is a 409; two
tenants may use the same id, in flight together, and each is billed once."""

from __future__ import annotations

import json
import uuid

import openai
import pytest

from tests.harness.servers import Server
from tests.harness.wait import wait_for

BASE = "tiny-llama"
MESSAGES = [{"role": "user", "content": "hi"}]


def _client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=120)


def _billed(server: Server, tenant_id: str, request_id: str) -> list[dict]:
    """The tenant's exported usage records with this id (once the meter has written them)."""

    def records() -> list[dict]:
        r = server.admin("GET", "/usage/export", params={"tenant_id": tenant_id, "limit": 1000})
        assert r.status_code == 200, r.text
        return [e for e in map(json.loads, r.text.splitlines()) if e["id"] == request_id]

    return wait_for(records, 30, interval=0.2, what=f"{request_id} billed to {tenant_id}")


def _long_stream(client: openai.OpenAI, request_id: str) -> openai.Stream:
    stream = client.chat.completions.create(
        model=BASE,
        messages=MESSAGES,
        max_tokens=200,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": request_id},
    )
    next(iter(stream))  # the first chunk: admitted and running
    return stream


@pytest.mark.slow
def test_client_request_id_is_the_request_id(server: Server) -> None:
    tenant_id, key = server.tenant("rid")
    rid = f"trace:{uuid.uuid4().hex[:12]}.span_1-a"
    raw = _client(server, key).chat.completions.with_raw_response.create(
        model=BASE, messages=MESSAGES, max_tokens=2, extra_headers={"X-Request-Id": rid}
    )
    assert raw.headers["x-request-id"] == rid  # echoed as sent
    chat = raw.parse()
    assert chat.id == f"chatcmpl-{rid}"
    (record,) = _billed(server, tenant_id, chat.id)
    assert record["data"]["completion_tokens"] == chat.usage.completion_tokens
    completion = _client(server, key).completions.create(
        model=BASE, prompt="x", max_tokens=1, extra_headers={"X-Request-Id": rid}
    )
    assert completion.id == f"cmpl-{rid}"  # its own prefix: no clash with the chat request
    # the tenant uses it again once billed: refused by name
    with pytest.raises(openai.ConflictError) as err:
        _client(server, key).chat.completions.create(
            model=BASE, messages=MESSAGES, max_tokens=2, extra_headers={"X-Request-Id": rid}
        )
    assert err.value.code == "request_id_in_use" and rid in err.value.message
    assert len(_billed(server, tenant_id, chat.id)) == 1


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["has space", "x" * 129, "semi;colon", "slash/y", ""])
def test_malformed_request_id_is_a_400_naming_the_header(server: Server, bad: str) -> None:
    _, key = server.tenant("rid")
    with pytest.raises(openai.BadRequestError) as err:
        _client(server, key).chat.completions.create(
            model=BASE, messages=MESSAGES, max_tokens=2, extra_headers={"X-Request-Id": bad}
        )
    assert err.value.code == "invalid_request_id" and err.value.param == "X-Request-Id"
    assert "X-Request-Id" in err.value.message and "1-128 characters" in err.value.message


@pytest.mark.slow
def test_same_id_in_flight_is_409_in_its_tenant_and_free_in_another(server: Server) -> None:
    (ta, ka), (tb, kb) = server.tenant("rid-a"), server.tenant("rid-b")
    rid = f"job-{uuid.uuid4().hex[:12]}"
    mine = _long_stream(_client(server, ka), rid)
    try:
        with pytest.raises(openai.ConflictError) as err:
            _client(server, ka).chat.completions.create(
                model=BASE, messages=MESSAGES, max_tokens=2, extra_headers={"X-Request-Id": rid}
            )
        assert err.value.code == "request_id_in_use" and rid in err.value.message
        theirs = _long_stream(_client(server, kb), rid)  # in flight beside tenant a's: no conflict
        theirs_text = "".join(c.choices[0].delta.content or "" for c in theirs if c.choices)
    finally:
        mine_text = "".join(c.choices[0].delta.content or "" for c in mine if c.choices)
    assert theirs_text and mine_text
    for tenant_id in (ta, tb):
        (record,) = _billed(server, tenant_id, f"chatcmpl-{rid}")
        assert record["data"]["tenant_id"] == tenant_id
        assert record["data"]["finish_reason"] == "length"
        assert record["data"]["completion_tokens"] == 200  # billed once each, in full
