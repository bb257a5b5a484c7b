"""Forced tool calls on a model whose chat template cannot render tools: the definitions go into the
system message (api/inference/tool_prompt.py), earlier tool turns become text, and the grammar admits
exactly one Hermes call with the markers as text; `tool_choice` "auto" stays refused."""

from __future__ import annotations

import json

import pytest

from api.errors import APIError
from api.inference.protocol import ChatCompletionRequest
from api.inference.tool_prompt import tools_system_text
from api.inference.tools import (
    forced_call_grammar,
    message_fields,
    plan_tools,
    template_messages,
    template_tools,
)
from base_engine.constraints import GrammarCompiler
from base_engine.model.tokenizer import render_chat
from base_engine.testing.tokenizer import build_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
# ChatML with no tools variable: what SmolLM2-Instruct and many small models ship
PLAIN = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer():
    tok = build_tokenizer(512, "llama3")
    tok.chat_template = PLAIN
    return tok


def body(choice, messages=None) -> ChatCompletionRequest:
    messages = messages or [{"role": "user", "content": "Weather in Paris?"}]
    return ChatCompletionRequest(model="m", messages=messages, tools=TOOLS, tool_choice=choice)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_go_through_the_system_prompt_and_one_call_by_grammar(choice) -> None:
    tok = tokenizer()
    plan = plan_tools(body(choice), tok)
    assert plan is not None and plan.in_system_prompt and plan.format == "hermes" and not plan.parallel
    assert template_tools(plan) is None  # nothing for the template, which would drop it
    messages = template_messages(body(choice), plan)
    assert messages[0] == {"role": "system", "content": tools_system_text(template_tools_of(plan))}
    text = render_chat(tok, messages)
    assert '"name":"get_weather"' in text and "<tool_call>" in text
    grammar = GrammarCompiler(tok, 512, [tok.eos_token_id]).compile_lark(forced_call_grammar(plan, tok))
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    ids = tok.encode(call, add_special_tokens=False)
    constraint = grammar.new_constraint()
    constraint.sync(ids)
    assert not constraint.is_error and constraint.is_accepting
    second = tok.encode(
        '\n<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>', add_special_tokens=False
    )
    constraint.sync(ids + second)
    assert constraint.is_error  # one call only
    content, calls = message_fields(plan, call)
    assert calls is not None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


def template_tools_of(plan):
    plan.in_system_prompt = False
    try:
        return template_tools(plan)
    finally:
        plan.in_system_prompt = True


def test_tool_turns_become_text_and_the_system_message_is_extended() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    plan = plan_tools(body("required", messages), tokenizer())
    out = template_messages(body("required", messages), plan)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>',
    }
    assert out[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}
    render_chat(tokenizer(), out)


@pytest.mark.parametrize("choice", ["auto", None])
def test_auto_stays_refused_with_todays_message(choice) -> None:
    with pytest.raises(APIError) as info:
        plan_tools(body(choice), tokenizer())
    assert info.value.status == 400
    assert "does not render tools; tool calling is not available for it" in str(info.value)
