"""Tool-call parsing for the three syntaxes (what a real instruct model writes under tool_choice "auto"),
streamed in pieces and whole, and the forced-call grammars, against the tiny tokenizers of each format."""

from __future__ import annotations

import json

import pytest

from api.inference.protocol import ChatCompletionRequest
from api.inference.tools import ToolPlan, detect_format, forced_call_grammar, message_fields, plan_tools
from base_engine.constraints import GrammarCompiler
from base_engine.testing.tokenizer import build_tokenizer

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time"}},
]


def plan(fmt: str, choice: str = "auto") -> ToolPlan:
    tokenizer = build_tokenizer(512, {"llama3_json": "llama3"}.get(fmt, fmt))
    body = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice=choice
    )
    p = plan_tools(body, tokenizer)
    assert p is not None and p.format == fmt
    return p


W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
T = '{"name": "get_time", "arguments": {}}'
CASES = {
    "hermes": [
        (f"<tool_call>\n{W}\n</tool_call>", None, ["get_weather"]),
        (
            f"Let me check.\n<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{T}\n</tool_call>",
            "Let me check.\n",
            None,
        ),
        ("Just text, no calls < here", "Just text, no calls < here", []),
        ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
        (f"<tool_call>\n{W}", None, ["get_weather"]),  # stopped before the closing tag
    ],
    "mistral": [
        (f"[TOOL_CALLS] [{W}, {T}]</s>", None, ["get_weather", "get_time"]),
        (f"Sure [TOOL_CALLS][{W}]", "Sure ", ["get_weather"]),
        ("[TOOL_CALLS] [{broken", "[TOOL_CALLS] [{broken", []),
        ("plain answer</s>", "plain answer", []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, ["get_weather"]),
        ('<|python_tag|>{"name": "get_time", "parameters": {}}; ' + W, None, ["get_time", "get_weather"]),
        ('{"city": "Paris"}', '{"city": "Paris"}', []),  # JSON, but not a call
        ("The weather is fine.", "The weather is fine.", []),
    ],
}
CASES["hermes"][1] = (CASES["hermes"][1][0], "Let me check.\n", ["get_weather", "get_time"])


@pytest.mark.parametrize("fmt,text,content,names", [(f, *c) for f, cases in CASES.items() for c in cases])
def test_parse_whole_and_streamed(fmt: str, text: str, content: str | None, names: list[str]) -> None:
    p = plan(fmt)
    got_content, calls = message_fields(p, text)
    assert [c["function"]["name"] for c in calls or []] == names
    assert got_content == (content if names else text.replace("</s>", ""))
    for call in calls or []:
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
        assert len(call["id"]) == 9 if fmt == "mistral" else call["id"].startswith("call_")
    # Streamed in uneven pieces: the same content and calls.
    parser = p.parser()
    streamed_content, streamed = "", []
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    for i, piece in enumerate(pieces):
        delta, deltas = parser.feed(piece, final=i == len(pieces) - 1)
        streamed_content += delta
        streamed += deltas
    assert [d["function"]["name"] for d in streamed] == names
    assert [d["index"] for d in streamed] == list(range(len(names)))
    assert (streamed_content or None) == (got_content or None)


def test_detect_format_from_the_template() -> None:
    assert detect_format(build_tokenizer(512, "llama3")) == "llama3_json"
    assert detect_format(build_tokenizer(512, "hermes")) == "hermes"
    assert detect_format(build_tokenizer(512, "mistral")) == "mistral"

    class NoTools:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    assert detect_format(NoTools()) is None


@pytest.mark.parametrize("fmt", ["hermes", "mistral", "llama3_json"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_grammars_compile_and_accept_a_call(fmt: str, choice: str) -> None:
    name = {"hermes": "hermes", "mistral": "mistral"}.get(fmt, "llama3")
    tokenizer = build_tokenizer(512, name)
    tool_choice = (
        "required" if choice == "required" else {"type": "function", "function": {"name": "get_time"}}
    )
    body = ChatCompletionRequest(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice=tool_choice
    )
    p = plan_tools(body, tokenizer)
    grammar = forced_call_grammar(p, tokenizer)
    eos = tokenizer.eos_token_id
    compiled = GrammarCompiler(tokenizer, 512, [eos]).compile_lark(grammar)
    key = "parameters" if fmt == "llama3_json" else "arguments"
    call = f'{{"name":"get_time","{key}":{{}}}}'  # compact: no whitespace outside strings
    text = {
        "hermes": f"<tool_call>\n{call}\n</tool_call>",
        "mistral": f"[TOOL_CALLS] [{call}]",
        "llama3_json": call,
    }[fmt]
    ids = tokenizer.encode(text, add_special_tokens=False) + [eos]
    constraint = compiled.new_constraint()
    constraint.sync(ids)
    assert not constraint.is_error, constraint.matcher.get_error()[:300]
    assert message_fields(p, text)[1][0]["function"]["name"] == "get_time"
