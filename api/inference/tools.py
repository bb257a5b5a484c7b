"""Tool calling: `tools` and tool turns rendered with the checkpoint's chat template, the model's tool-call
syntax parsed back into OpenAI `tool_calls` (whole, or as streaming deltas), and forced calls
(`tool_choice` "required" or a named function) enforced by a grammar in the model's own syntax.

The syntax is the checkpoint's, recognised from its chat template:

- `llama3_json` (Llama 3.1+): `{"name": "f", "parameters": {...}}`, several joined by `; `, optionally
  after `<|python_tag|>`;
- `hermes` (Qwen2/2.5, Hermes): `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, a
  block per call;
- `mistral` (Mistral v0.3+): `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`.

`tool_choice`: "none" (tools are rendered, output is never parsed), "auto" (default when tools are given:
free text, parsed), "required" (one or more calls, `parallel_tool_calls=false`: exactly one), or
`{"type": "function", "function": {"name"}}` (exactly that call). A forced call's finish reason is
"tool_calls" for "required" and "stop" for a named function, as OpenAI answers; parsed calls under "auto"
finish with "tool_calls".

Text that looks like a call but does not parse (a block that is not JSON, an unknown function) stays in
`content`, so nothing the model wrote is lost. The parser (output -> calls) is api/inference/tool_parser.py.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from adapters.files import json_depth
from api.errors import APIError
from api.inference.protocol import ChatCompletionRequest, ChatMessage, ToolDefinition
from api.inference.tool_parser import (
    HERMES_CLOSE,
    HERMES_OPEN,
    MISTRAL_MARKER,
    TOOL_FORMATS,
    ToolCallParser,
    ToolFormat,
    new_call_id,
)
from api.inference.tool_prompt import system_prompt_messages
from base_engine.constraints import lark_json

logger = logging.getLogger(__name__)

_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def detect_format(tokenizer: Any) -> ToolFormat | None:
    """The tool-call syntax of the checkpoint's chat template; None when it renders no tools."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: "tool_use" is the one with tools
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str):
        return None
    if HERMES_OPEN in template:
        return "hermes"
    if MISTRAL_MARKER in template:
        return "mistral"
    if "tools" in template:
        return "llama3_json"
    return None


# ---- the request ------------------------------------------------------------------------------------


@dataclass(slots=True)
class ToolPlan:
    """What a chat request asked of tools; `None` in place of a plan means no tools at all."""

    format: ToolFormat
    tools: list[ToolDefinition]
    choice: str  # "none" | "auto" | "required" | "function"
    function: str | None = None  # the named function
    parallel: bool = True
    special_tokens: tuple[str, ...] = ()  # stripped from content when specials are kept in the text
    # The template cannot render tools: they go into the system message (api/inference/tool_prompt.py).
    in_system_prompt: bool = False

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    @property
    def keeps_special_tokens(self) -> bool:
        """Mistral's marker is a special token: the text must keep specials for it to be seen."""
        return self.parses and self.format == "mistral"

    def parser(self) -> ToolCallParser:
        specials = self.special_tokens if self.keeps_special_tokens else ()
        return ToolCallParser(self.format, {t.function.name for t in self.tools}, specials)


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


# JSON nesting of one tool's `parameters` schema (real ones: under 10). The chat template renders the
# schema recursively, so a schema nested some hundreds deep would exhaust the interpreter's stack.
MAX_TOOL_SCHEMA_DEPTH = 64


def _check_schema_depths(tools: list[ToolDefinition]) -> None:
    for i, tool in enumerate(tools):
        if json_depth(tool.function.parameters, MAX_TOOL_SCHEMA_DEPTH) > MAX_TOOL_SCHEMA_DEPTH:
            param = f"tools[{i}].function.parameters"
            raise _bad(f"{param} nests deeper than the limit of {MAX_TOOL_SCHEMA_DEPTH} levels", param)


def plan_tools(body: ChatCompletionRequest, tokenizer: Any, override: str | None = None) -> ToolPlan | None:
    """Checks `tools`, `tool_choice` and `parallel_tool_calls` together; None without tools."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise _bad("`tool_choice` is only allowed when `tools` are given", "tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise _bad("tool function names must be unique", "tools")
    _check_schema_depths(tools)
    parallel = body.parallel_tool_calls is not False
    if choice is None or isinstance(choice, str):
        kind = choice or "auto"
        function = None
    else:
        kind, function = "function", choice.function.name
        if function not in names:
            raise _bad(f"tool_choice names function {function!r}, which is not among `tools`", "tool_choice")
    fmt = override if override and override != "auto" else detect_format(tokenizer)
    in_system_prompt = fmt is None and kind in ("required", "function")
    if in_system_prompt:  # forced calls on any model: tools in the system message, one call by grammar
        fmt, parallel = "hermes", False
    if fmt is None:
        raise _bad(
            "this model's chat template does not render tools; tool calling is not available for it",
            "tools",
        )
    if fmt not in TOOL_FORMATS:
        raise APIError(500, f"unknown tool call parser {fmt!r}", code="server_misconfigured")
    specials = tuple(getattr(tokenizer, "all_special_tokens", ()) or ())
    plan = ToolPlan(fmt, list(tools), kind, function, parallel, specials, in_system_prompt)  # type: ignore[arg-type]
    return plan


def template_messages(body: ChatCompletionRequest, plan: ToolPlan | None) -> list[dict[str, Any]]:
    """Messages as chat templates expect them (tool-call arguments as objects, tool results by id)."""
    fmt = plan.format if plan else None
    messages = [_template_message(m, fmt) for m in body.messages]
    if plan is not None and plan.in_system_prompt:
        return system_prompt_messages(messages, _openai_tools(plan))
    return messages


def template_tools(plan: ToolPlan | None) -> list[dict[str, Any]] | None:
    """`tools` for the chat template; None without tools or when they are in the system message."""
    if plan is None or plan.in_system_prompt:
        return None
    return _openai_tools(plan)


def _openai_tools(plan: ToolPlan) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": t.function.name,
                **({"description": t.function.description} if t.function.description else {}),
                "parameters": t.function.parameters or {"type": "object", "properties": {}},
            },
        }
        for t in plan.tools
    ]


def _template_id(call_id: str, fmt: ToolFormat | None) -> str:
    return call_id[-9:].rjust(9, "0") if fmt == "mistral" else call_id


def _template_message(message: ChatMessage, fmt: ToolFormat | None) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.name is not None:  # templates that know participants' names render it (OpenAI's `name`)
        out["name"] = message.name
    if message.role == "assistant" and message.tool_calls:
        calls = []
        for call in message.tool_calls:
            try:
                arguments: Any = json.loads(call.function.arguments)
            except ValueError:
                arguments = call.function.arguments
            calls.append(
                {
                    "id": _template_id(call.id, fmt),
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": arguments},
                }
            )
        out["tool_calls"] = calls
    if message.role == "tool":
        if message.tool_call_id is None:
            raise _bad("messages with role 'tool' need a `tool_call_id`", "messages")
        out["tool_call_id"] = _template_id(message.tool_call_id, fmt)
    elif message.tool_call_id is not None:
        raise _bad("`tool_call_id` belongs only on messages with role 'tool'", "messages")
    if message.tool_calls and message.role != "assistant":
        raise _bad("`tool_calls` belong only on messages with role 'assistant'", "messages")
    return out


# ---- the grammar of forced calls --------------------------------------------------------------------


def _call_schema(tool: ToolDefinition, arguments_key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.function.name},
            arguments_key: tool.function.parameters or _NO_ARGUMENTS,
        },
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _lark_marker(tokenizer: Any, marker: str) -> str:
    """A marker in a grammar: by token id when the tokenizer has it as one added token (Qwen's
    <tool_call>), which a grammar must name as a token; else as text."""
    added = getattr(tokenizer, "get_added_vocab", dict)()
    if marker in added:
        return f"<[{int(added[marker])}]>"
    return json.dumps(marker)


def forced_call_grammar(plan: ToolPlan, tokenizer: Any, *, whitespace: bool = False) -> str | None:
    """A Lark grammar (llguidance dialect) of the calls that "required" or a named choice allows, in the
    checkpoint's own syntax; None when nothing is forced."""
    if plan.choice not in ("required", "function"):
        return None
    tools = [t for t in plan.tools if plan.choice == "required" or t.function.name == plan.function]
    key = "parameters" if plan.format == "llama3_json" else "arguments"
    one = {"anyOf": [_call_schema(t, key) for t in tools]} if len(tools) > 1 else _call_schema(tools[0], key)
    many = plan.parallel and plan.choice == "required"
    if plan.format == "mistral":
        marker = tokenizer.convert_tokens_to_ids(MISTRAL_MARKER)
        array = {"type": "array", "items": one, "minItems": 1, **({} if many else {"maxItems": 1})}
        return f'start: <[{int(marker)}]> " "? calls\ncalls: {lark_json(array, whitespace=whitespace)}\n'
    obj = lark_json(one, whitespace=whitespace)
    if plan.format == "hermes":
        repeat = ' ("\\n" call)*' if many else ""
        open_, close = _lark_marker(tokenizer, HERMES_OPEN), _lark_marker(tokenizer, HERMES_CLOSE)
        return f'start: call{repeat}\ncall: {open_} "\\n" obj "\\n" {close}\nobj: {obj}\n'
    repeat = ' ("; " obj)*' if many else ""
    return f"start: obj{repeat}\nobj: {obj}\n"


# ---- the finished message (parsing itself: api/inference/tool_parser.py)
# --------------------------------------


def message_fields(plan: ToolPlan | None, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(content, tool_calls) of a finished choice's message."""
    if plan is None or not plan.parses:
        return text, None
    parsed = plan.parser().parse(text)
    if not parsed.calls:
        return parsed.content or "", None
    calls = [call.to_openai(new_call_id(plan.format)) for call in parsed.calls]
    return (None if plan.choice == "function" else parsed.content), calls


def finish_reason(plan: ToolPlan | None, reason: str | None, num_calls: int) -> str | None:
    if plan is None or reason != "stop" or num_calls == 0 or plan.choice == "function":
        return reason
    return "tool_calls"
