"""Stored responses through the official `openai` client against a real server, on both backends:
`responses.create(store=True)`, `responses.retrieve`, `previous_response_id` (the stored conversation
comes before the new input: its prompt is the chat path's for the whole conversation, token for token,
and chains), `responses.stream(store=True)`, `responses.delete`; another tenant's id and an unstored
one are 404 `response_not_found`; past the retention (a server with 2 s) a 404 naming it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.harness.servers import Server, launch_server, main_server_args

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"


def _client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=120)


def _ask(client: openai.OpenAI, text: str, **kwargs: object) -> openai.types.responses.Response:
    return client.responses.create(model=MODEL, input=text, max_output_tokens=4, temperature=0, **kwargs)


def _chat_prompt_tokens(client: openai.OpenAI, messages: list[dict[str, str]]) -> int:
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    return chat.usage.prompt_tokens


def test_store_retrieve_continue_and_delete(server: Server) -> None:
    _, key = server.tenant("stored")
    client = _client(server, key)
    first = _ask(client, "one", store=True)
    assert first.store is True
    kept = client.responses.retrieve(first.id)
    assert kept.id == first.id and kept.output_text == first.output_text and kept.usage == first.usage
    # previous_response_id: the stored conversation, then the new input (instructions not carried)
    second = _ask(client, "two", store=True, previous_response_id=first.id, instructions="be brief")
    assert second.previous_response_id == first.id
    conversation = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "two"},
    ]
    assert second.usage.input_tokens == _chat_prompt_tokens(
        client, [{"role": "system", "content": "be brief"}, *conversation]
    )
    third = _ask(client, "three", previous_response_id=second.id)  # a chain: both earlier turns
    conversation += [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "three"},
    ]
    assert third.usage.input_tokens == _chat_prompt_tokens(client, conversation)
    with pytest.raises(openai.NotFoundError) as err:  # not stored: store omitted
        client.responses.retrieve(third.id)
    assert err.value.code == "response_not_found"
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    assert client.responses.retrieve(second.id).id == second.id  # the others stay


def test_a_streamed_response_is_stored(server: Server) -> None:
    _, key = server.tenant("stored-stream")
    client = _client(server, key)
    with client.responses.stream(model=MODEL, input="hello", max_output_tokens=4, store=True) as stream:
        # the random tiny model runs to max_output_tokens: response.incomplete ends the stream
        (final,) = [e.response for e in stream if e.type in ("response.completed", "response.incomplete")]
    kept = client.responses.retrieve(final.id)
    assert kept.output_text == final.output_text and kept.status == final.status


def test_another_tenants_response_is_never_found(server: Server) -> None:
    (_, ka), (_, kb) = server.tenant("stored-a"), server.tenant("stored-b")
    mine = _ask(_client(server, ka), "secret", store=True)
    theirs = _client(server, kb)
    with pytest.raises(openai.NotFoundError) as err:
        theirs.responses.retrieve(mine.id)
    assert err.value.code == "response_not_found"
    with pytest.raises(openai.NotFoundError) as err:
        _ask(theirs, "and?", previous_response_id=mine.id)
    assert err.value.code == "response_not_found" and err.value.param == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        theirs.responses.delete(mine.id)
    assert _client(server, ka).responses.retrieve(mine.id).id == mine.id  # still there for its tenant


@pytest.fixture(scope="module")
def short_retention(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("short-retention")
    env = {"LORASERVE_RESPONSE_RETENTION_S": "2"}
    with launch_server(main_server_args(tiny_llama_dir), tmp / "data", env=env) as started:
        yield started


def test_an_expired_response_is_a_404_naming_the_retention(short_retention: Server) -> None:
    _, key = short_retention.tenant("stored-exp")
    client = _client(short_retention, key)
    old = _ask(client, "soon gone", store=True)
    time.sleep(2.5)
    for call in (
        lambda: client.responses.retrieve(old.id),
        lambda: _ask(client, "x", previous_response_id=old.id),
    ):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert err.value.code == "response_not_found"
        assert "expired" in err.value.message and "2 s (response_retention_s)" in err.value.message
