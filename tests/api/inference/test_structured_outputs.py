"""`response_format` through the official `openai` client against a real server: every output of the tiny
random model parses and validates against its schema, on the base model and on an adapter, in batches
that mix constrained and free requests."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.harness.servers import Server
from tests.harness.uploads import files_of, peft_adapter, upload

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("server", ["sqlite-local"], indirect=True)]

BASE = "tiny-llama"
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "flags": {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "level": {"enum": ["low", "mid", "high"]},
            "note": {"type": ["string", "null"], "maxLength": 6},
        },
        "required": ["ok", "level", "note"],
        "additionalProperties": False,
    },
    "list": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": -9, "maximum": 99},
                "minItems": 1,
                "maxItems": 4,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "maximum": 999},
                    "y": {"type": "integer", "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"type": "string", "pattern": "^[a-z]{1,5}$"},
        },
        "required": ["point", "label"],
        "additionalProperties": False,
    },
    "choice": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "a"}, "n": {"type": "integer", "maximum": 9}},
                "required": ["kind", "n"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "b"}, "s": {"type": "string", "maxLength": 4}},
                "required": ["kind", "s"],
                "additionalProperties": False,
            },
        ]
    },
}
PER_SCHEMA = 10  # 5 schemas x 10 = 50 outputs per model


@pytest.fixture(scope="module")
def key(server: Server) -> str:
    return server.tenant("so")[1]


@pytest.fixture(scope="module")
def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def adapter(server: Server, key: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = peft_adapter(tmp_path_factory.mktemp("so") / "a", seed=3)
    r = upload(server, key, "json-bot", files_of(directory))
    assert r.status_code == 201, r.text
    return "json-bot"


def _schema_request(client: openai.OpenAI, model: str, name: str) -> list[tuple[str, str]]:
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Give me a {name} as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
        },
        n=PER_SCHEMA,
        temperature=1.0,
        max_tokens=120,
    )
    return [(name, c.message.content) for c in chat.choices if c.finish_reason == "stop"] + [
        (name, f"cut: {c.message.content}") for c in chat.choices if c.finish_reason != "stop"
    ]


@pytest.mark.parametrize("use_adapter", [False, True], ids=["base", "adapter"])
def test_50_outputs_parse_and_validate(client: openai.OpenAI, adapter: str, use_adapter: bool) -> None:
    model = adapter if use_adapter else BASE
    # All schemas at once, with free requests in the same batches.
    with ThreadPoolExecutor(8) as pool:
        free = [
            pool.submit(
                client.chat.completions.create,
                model=BASE if i % 2 else adapter,
                messages=[{"role": "user", "content": "Tell me a story"}],
                max_tokens=20,
                temperature=1.0,
            )
            for i in range(4)
        ]
        outputs = [
            o for f in [pool.submit(_schema_request, client, model, n) for n in SCHEMAS] for o in f.result()
        ]
        assert all(f.result().choices[0].message.content is not None for f in free)
    assert len(outputs) == 50
    for name, text in outputs:
        jsonschema.validate(json.loads(text), SCHEMAS[name])  # a cut output fails to parse here


def test_json_object_and_streaming(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=BASE,
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["person"]}},
        stream=True,
        seed=4,
        max_tokens=120,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS["person"])
    chat = client.chat.completions.create(
        model=BASE,
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"},
        n=4,
        seed=5,
        max_tokens=200,
    )
    for choice in chat.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # the tiny random model may write long strings: cut at max_tokens, still an object's start
            assert choice.message.content.startswith("{")


@pytest.mark.parametrize(
    "response_format,param",
    [
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
            "response_format.json_schema.schema",
        ),
        ({"type": "json_object", "schema": {}}, "response_format"),
    ],
)
def test_bad_response_format_is_a_400_naming_the_field(
    client: openai.OpenAI, response_format: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": "hi"}], response_format=response_format
        )
    assert info.value.body["param"] == param, info.value.body


def test_completions_take_response_format_too(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=BASE,
        prompt="A person:",
        max_tokens=120,
        n=4,
        seed=9,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": SCHEMAS["person"]},
            }
        },
    )
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.text), SCHEMAS["person"])


def test_text_format_is_plain(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=BASE,
        messages=[{"role": "user", "content": "hi"}],
        response_format={"type": "text"},
        max_tokens=4,
        temperature=0,
    )
    plain = client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].message.content == plain.choices[0].message.content
