"""`POST /v1/responses` through the official `openai` client (`responses.create`, `responses.stream`)
against a real server on a tiny Qwen2 (Hermes tool calls): text, instructions and item inputs, forced
function calls, `text.format` JSON, usage equal to the chat path's, and unknown fields refused by name
(stored responses: tests/api/inference/test_stored_responses.py)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.harness.servers import ADMIN_KEY, ServerProcess

pytestmark = pytest.mark.slow  # a real server

MODEL = "tiny"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}


@pytest.fixture(scope="module")
def client(
    make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[openai.OpenAI]:
    model_dir = make_checkpoint(arch="qwen2", seed=2, chat_format="hermes")
    tmp = tmp_path_factory.mktemp("responses")
    args = ["--model", str(model_dir), "--served-model-name", MODEL, "--max-model-len", "1024"]
    args += ["--num-kv-blocks", "512", "--max-num-seqs", "8"]
    process = ServerProcess(args, tmp / "data", env={"LORASERVE_ADMIN_KEY": ADMIN_KEY}).start()
    try:
        r = httpx.post(
            f"{process.base_url}/admin/api/tenants",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            json={"name": f"resp-{uuid.uuid4().hex[:8]}"},
            timeout=60,
        )
        assert r.status_code == 201, r.text
        yield openai.OpenAI(
            base_url=f"{process.base_url}/v1", api_key=r.json()["api_key"], max_retries=0, timeout=300
        )
    finally:
        process.stop()


def test_create_matches_chat_and_reports_usage(client: openai.OpenAI) -> None:
    resp = client.responses.create(
        model=MODEL, instructions="Be brief.", input="Hello there", max_output_tokens=12, temperature=0
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        max_tokens=12,
        temperature=0,
    )
    assert resp.object == "response" and resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens == 12
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"


def test_stream_events_assemble_the_same_answer(client: openai.OpenAI) -> None:
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}]
    whole = client.responses.create(model=MODEL, input=items, max_output_tokens=10, temperature=0)
    with client.responses.stream(model=MODEL, input=items, max_output_tokens=10, temperature=0) as stream:
        events = list(stream)
    final = events[-1].response  # cut by max_output_tokens: response.incomplete, as OpenAI sends
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "response.output_text.delta" in kinds and "response.output_text.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text


def test_forced_function_call_and_its_output_turn(client: openai.OpenAI) -> None:
    resp = client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=[TOOL], tool_choice="required", max_output_tokens=64
    )
    calls = [o for o in resp.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", resp.output
    assert set(json.loads(calls[0].arguments)) == {"city"}
    followup = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "type": "function_call",
            "call_id": calls[0].call_id,
            "name": "get_weather",
            "arguments": calls[0].arguments,
        },
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C"},
    ]
    again = client.responses.create(
        model=MODEL, input=followup, tools=[TOOL], tool_choice="none", max_output_tokens=4
    )
    assert again.usage.input_tokens > resp.usage.input_tokens
    with client.responses.stream(
        model=MODEL, input="Weather?", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"}
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and final.output[0].type == "function_call"


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    resp = client.responses.create(
        model=MODEL,
        input="JSON please",
        text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True}},
        max_output_tokens=64,
    )
    assert resp.status == "completed" and set(json.loads(resp.output_text)) == {"city"}
    assert " " not in resp.output_text.split('"city"')[0]  # compact JSON


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"nope": 1}, "nope"),
    ],
)
def test_refused_by_name(client: openai.OpenAI, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="hi", extra_body=extra)
    assert param in str(info.value.body)
