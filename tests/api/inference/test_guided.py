"""vLLM's `structured_outputs` and the older `guided_*` fields through the official `openai` client
against a real server: every output of the tiny random model obeys its constraint (a regex, a choice, a
Lark grammar, a JSON schema); what we cannot honour is a 400 naming the field (api/inference/guided.py)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.harness.servers import Server

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("server", ["sqlite-local"], indirect=True)]

BASE = "tiny-llama"
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
}
REGEX = r"[a-c]{2}-\d{3}"
CHOICES = ["Paris", "London", "Rome"]
GRAMMAR = 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.tenant("g")[1], max_retries=0)


def _texts(client: openai.OpenAI, extra: dict, *, chat: bool) -> list[str]:
    if chat:
        r = client.chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": "Pick."}], max_tokens=40, n=3, seed=3,
            temperature=1.0, extra_body=extra,
        )  # fmt: skip
        return [c.message.content for c in r.choices]
    r = client.completions.create(model=BASE, prompt="Pick:", max_tokens=40, n=3, seed=4, extra_body=extra)
    return [c.text for c in r.choices]


@pytest.mark.parametrize("chat", [True, False])
def test_constraints_hold(server: Server, chat: bool) -> None:
    client = _client(server)
    checks = [
        ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
        ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
        ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
        ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
        ({"guided_grammar": GRAMMAR}, lambda t: re.fullmatch(r"yes|no|maybe [0-9]", t)),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, lambda t: " " not in t and json.loads(t)),
        # Any object: the random model's free strings may run past max_tokens, so only its start is checked.
        ({"structured_outputs": {"json_object": True}}, lambda t: t.startswith('{"')),
    ]
    for extra, ok in checks:
        for text in _texts(client, extra, chat=chat):
            assert ok(text), (extra, text)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        (
            {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
        ),
        ({"structured_outputs": {"frob": 1}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_grammar": "start: ???"}, "guided_grammar"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ],
)
def test_what_we_cannot_honour_is_refused_by_name(server: Server, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _client(server).completions.create(model=BASE, prompt="x", max_tokens=4, extra_body=extra)
    assert info.value.body["param"] == param, info.value.body
