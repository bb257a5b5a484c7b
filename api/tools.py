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
`content`, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import logging
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Literal

from api.errors import APIError
from api.protocol import ChatCompletionRequest, ChatMessage, ToolDefinition
from base_engine.structured import lark_json

logger = logging.getLogger(__name__)

ToolFormat = Literal["llama3_json", "hermes", "mistral"]
TOOL_FORMATS: tuple[str, ...] = ("llama3_json", "hermes", "mistral")

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARKER = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
_ALNUM = string.ascii_letters + string.digits
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


def new_call_id(fmt: ToolFormat) -> str:
    # Mistral's templates require ids of exactly 9 letters and digits.
    if fmt == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


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

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    @property
    def keeps_special_tokens(self) -> bool:
        """Mistral's marker is a special token: the text must keep specials for it to be seen."""
        return self.parses and self.format == "mistral"

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self)


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


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
    fmt = override if override and override != "auto" else detect_format(tokenizer)
    if fmt is None:
        raise _bad(
            "this model's chat template does not render tools; tool calling is not available for it",
            "tools",
        )
    if fmt not in TOOL_FORMATS:
        raise APIError(500, f"unknown tool call parser {fmt!r}", code="server_misconfigured")
    parallel = body.parallel_tool_calls is not False
    if choice is None or isinstance(choice, str):
        kind = choice or "auto"
        function = None
    else:
        kind, function = "function", choice.function.name
        if function not in names:
            raise _bad(f"tool_choice names function {function!r}, which is not among `tools`", "tool_choice")
    specials = tuple(getattr(tokenizer, "all_special_tokens", ()) or ())
    return ToolPlan(fmt, list(tools), kind, function, parallel, specials)  # type: ignore[arg-type]


def template_messages(body: ChatCompletionRequest, plan: ToolPlan | None) -> list[dict[str, Any]]:
    """Messages as chat templates expect them (tool-call arguments as objects, tool results by id)."""
    fmt = plan.format if plan else None
    return [_template_message(m, fmt) for m in body.messages]


def template_tools(plan: ToolPlan | None) -> list[dict[str, Any]] | None:
    if plan is None:
        return None
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


def forced_call_grammar(plan: ToolPlan, tokenizer: Any) -> str | None:
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
        return f'start: <[{int(marker)}]> " "? calls\ncalls: {lark_json(array)}\n'
    if plan.format == "hermes":
        repeat = ' ("\\n" call)*' if many else ""
        open_, close = _lark_marker(tokenizer, HERMES_OPEN), _lark_marker(tokenizer, HERMES_CLOSE)
        return f'start: call{repeat}\ncall: {open_} "\\n" obj "\\n" {close}\nobj: {lark_json(one)}\n'
    repeat = ' ("; " obj)*' if many else ""
    return f"start: obj{repeat}\nobj: {lark_json(one)}\n"


# ---- parsing the output -----------------------------------------------------------------------------


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text

    def to_openai(self, call_id: str) -> dict[str, Any]:
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(slots=True)
class Parsed:
    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


def _call_from(obj: Any, names: set[str]) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


_DECODER = json.JSONDecoder()


def _json_values(text: str, separator: str) -> list[tuple[Any, int, int]]:
    """JSON values at the start of `text`, separated by `separator` (and whitespace), with where each
    starts and ends. Stops at the first thing that is not one."""
    values: list[tuple[Any, int, int]] = []
    pos = 0
    while True:
        start = len(text) - len(text[pos:].lstrip())
        if values:
            if not text.startswith(separator, start):
                break
            start += len(separator)
            start = len(text) - len(text[start:].lstrip())
        try:
            value, end = _DECODER.raw_decode(text, start)
        except ValueError:
            break
        values.append((value, start, end))
        pos = end
    return values


class ToolCallParser:
    """Parses one choice's output; `feed` for streams (content and whole calls as they complete),
    `parse` for a finished text. Both give the same content and calls."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.names = {t.function.name for t in plan.tools}
        self._text = ""
        self._content_sent = 0  # characters of the content prefix already streamed
        self._calls_sent = 0
        self.call_ids: list[str] = []

    # -- whole text --

    def _clean(self, text: str) -> str:
        if self.plan.keeps_special_tokens:
            for special in self.plan.special_tokens:
                if special != MISTRAL_MARKER:
                    text = text.replace(special, "")
        return text

    def _split(self, text: str) -> tuple[int, int]:
        """(end of the content prefix, start of the tool section); len(text) twice when no section."""
        fmt = self.plan.format
        if fmt == "hermes":
            i = text.find(HERMES_OPEN)
            return (i, i) if i >= 0 else (len(text), len(text))
        if fmt == "mistral":
            i = text.find(MISTRAL_MARKER)
            return (i, i + len(MISTRAL_MARKER)) if i >= 0 else (len(text), len(text))
        stripped = text.lstrip()
        lead = len(text) - len(stripped)
        if stripped.startswith(PYTHON_TAG):
            return lead, lead + len(PYTHON_TAG)
        if stripped.startswith("{"):
            return lead, lead
        return len(text), len(text)

    def _calls(self, section: str, final: bool) -> tuple[list[ParsedCall], str]:
        """Complete calls in the tool section, and the text of it that did not parse (when final)."""
        fmt = self.plan.format
        calls: list[ParsedCall] = []
        rest = ""
        if fmt == "hermes":
            pos = 0
            while True:
                start = section.find(HERMES_OPEN, pos)
                if start < 0:
                    rest += section[pos:] if final else ""
                    break
                rest += section[pos:start]
                end = section.find(HERMES_CLOSE, start)
                if end < 0 and not final:
                    break
                body_end = end if end >= 0 else len(section)
                body = section[start + len(HERMES_OPEN) : body_end]
                call = None
                try:
                    call = _call_from(json.loads(body), self.names)
                except ValueError:
                    pass
                block_end = body_end + len(HERMES_CLOSE) if end >= 0 else body_end
                if call is None:
                    rest += section[start:block_end]
                else:
                    calls.append(call)
                pos = block_end
            return calls, rest.strip() if final else ""
        if fmt == "mistral":  # one array, all or nothing (it parses only once complete)
            values = _json_values(section, ",")
            items = values[0][0] if values and isinstance(values[0][0], list) else None
            parsed = [_call_from(v, self.names) for v in items] if items else [None]
            if any(c is None for c in parsed):
                return [], section if final else ""
            return [c for c in parsed if c is not None], section[values[0][2] :].strip() if final else ""
        # llama3_json: the valid calls up to the first value that is not one; the rest stays text
        rest_start = 0
        for value, start, end in _json_values(section, ";"):
            call = _call_from(value, self.names)
            if call is None:
                rest_start = start
                break
            calls.append(call)
            rest_start = end
        return calls, section[rest_start:].strip() if final else ""

    def parse(self, text: str) -> Parsed:
        text = self._clean(text)
        content_end, section_start = self._split(text)
        content = text[:content_end]
        section = text[section_start:]
        calls, rest = self._calls(section, final=True) if section else ([], "")
        if not calls:  # nothing parsed: the whole text is the message
            return Parsed(text if text.strip() else None)
        full = content + rest
        return Parsed(full if full.strip() else None, calls)

    # -- streams --

    def _held(self, text: str) -> int:
        """Characters at the end that may be the start of a marker (or of a special token that is cut
        from the content): not streamed as content yet."""
        fmt = self.plan.format
        if fmt == "llama3_json":  # a call can only start the text
            stripped = text.lstrip()
            return len(text) if not stripped or PYTHON_TAG.startswith(stripped) else 0
        markers = [HERMES_OPEN if fmt == "hermes" else MISTRAL_MARKER]
        if self.plan.keeps_special_tokens:
            markers += self.plan.special_tokens
        longest = max(len(m) for m in markers) - 1
        for n in range(min(longest, len(text)), 0, -1):
            if any(m.startswith(text[-n:]) for m in markers):
                return n
        return 0

    def feed(self, delta: str, *, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """Content delta and tool-call deltas (OpenAI `delta.tool_calls` entries) for new text."""
        self._text += delta
        text = self._clean(self._text)
        if final:
            parsed = self.parse(self._text)
            content = parsed.content or ""
            calls = parsed.calls
        else:
            content_end, section_start = self._split(text)
            if section_start < len(text) or content_end < len(text):
                content = text[:content_end]
                calls, _ = self._calls(text[section_start:], final=False)
            else:
                content = text[: len(text) - self._held(text)]
                calls = []
        if not content.strip():  # whitespace before a call is not worth a delta
            content = ""
        content_delta = content[self._content_sent :] if len(content) > self._content_sent else ""
        self._content_sent = max(self._content_sent, len(content))
        deltas = []
        for call in calls[self._calls_sent :]:
            index = len(self.call_ids)
            self.call_ids.append(new_call_id(self.plan.format))
            deltas.append({"index": index, **call.to_openai(self.call_ids[-1])})
        self._calls_sent = max(self._calls_sent, len(calls))
        return content_delta, deltas

    @property
    def num_calls(self) -> int:
        return len(self.call_ids)


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
