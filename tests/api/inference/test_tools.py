"""Tool calling through the official `openai` client against real servers, one per tool-call syntax (a
tiny Llama with Llama 3.1's JSON calls, a tiny Qwen2 with Hermes <tool_call> blocks, a tiny Mistral
with [TOOL_CALLS]): forced calls ("required", a named function) parse into `tool_calls` that validate
against the tools' schemas, whole and streamed; tool turns render through the checkpoint's template."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.harness.servers import ADMIN_KEY, ServerProcess

pytestmark = pytest.mark.slow  # real servers

MODEL = "tiny"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORMATS = {"llama3": ("llama", 0), "hermes": ("qwen2", 2), "mistral": ("mistral", 1)}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def client(
    request: pytest.FixtureRequest,
    make_checkpoint: Callable[..., Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[openai.OpenAI]:
    arch, seed = FORMATS[request.param]
    model_dir = make_checkpoint(arch=arch, seed=seed, chat_format=request.param)
    tmp = tmp_path_factory.mktemp(f"tools-{request.param}")
    args = ["--model", str(model_dir), "--served-model-name", MODEL, "--max-model-len", "1024"]
    args += ["--num-kv-blocks", "512", "--max-num-seqs", "8"]
    process = ServerProcess(args, tmp / "data", env={"LORASERVE_ADMIN_KEY": ADMIN_KEY}).start()
    try:
        r = httpx.post(
            f"{process.base_url}/admin/api/tenants",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            json={"name": f"tools-{uuid.uuid4().hex[:8]}"},
            timeout=60,
        )
        assert r.status_code == 201, r.text
        yield openai.OpenAI(
            base_url=f"{process.base_url}/v1", api_key=r.json()["api_key"], max_retries=0, timeout=300
        )
    finally:
        process.stop()


def _check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_gives_one_valid_call(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        n=4,
        temperature=1.0,
        max_tokens=100,
    )
    for choice in chat.choices:
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert len(calls) == 1 and calls[0].type == "function" and calls[0].id
        _check_call(calls[0].function.name, calls[0].function.arguments)


def test_named_function_is_called(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        seed=3,
        max_tokens=100,
    )
    choice = chat.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    _check_call("get_time", choice.message.tool_calls[0].function.arguments)


def test_streamed_calls_assemble_like_the_whole_response(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", seed=11, max_tokens=300)
    whole = client.chat.completions.create(**kwargs).choices[0]
    stream = client.chat.completions.create(**kwargs, stream=True)
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    for chunk in stream:
        for choice in chunk.choices:
            reasons += [choice.finish_reason] if choice.finish_reason else []
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    assert reasons == [whole.finish_reason]
    if whole.finish_reason == "tool_calls":  # the random model may also run out of tokens mid-list
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls
        ]
        for call in calls.values():
            _check_call(call["name"], call["arguments"])
            assert call["id"]


def test_tool_turns_render_and_none_never_calls(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=5
    )
    message = first.choices[0].message
    history = [*ASK, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "sunny"}]
    followup = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert followup.choices[0].message.tool_calls is None
    assert followup.choices[0].finish_reason in ("stop", "length")
    # The call and its result are in the prompt: longer than the question alone.
    alone = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1
    )
    assert followup.usage.prompt_tokens > alone.usage.prompt_tokens + 10


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ],
)
def test_bad_tool_requests_are_400s(client: openai.OpenAI, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, **kwargs)
    assert info.value.body["param"] == param, info.value.body
