"""Parsing a model's output back into OpenAI `tool_calls`: the three tool-call syntaxes (`llama3_json`,
`hermes`, `mistral`; see api/inference/tools.py), whole texts and streamed deltas.

Separate from api/inference/tools.py, which plans a request's tools (validation, templates, the forced-call
grammar): this is the output side, and it needs only the syntax and the tool names, not the request.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Literal

ToolFormat = Literal["llama3_json", "hermes", "mistral"]
TOOL_FORMATS: tuple[str, ...] = ("llama3_json", "hermes", "mistral")

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARKER = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
_ALNUM = string.ascii_letters + string.digits


def new_call_id(fmt: ToolFormat) -> str:
    # Mistral's templates require ids of exactly 9 letters and digits.
    if fmt == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


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

    def __init__(self, fmt: ToolFormat, names: set[str], specials: tuple[str, ...] = ()) -> None:
        """`specials`: special tokens kept in the text (Mistral's marker is one), cut from the content."""
        self.format = fmt
        self.names = names
        self.specials = specials
        self._text = ""
        self._content_sent = 0  # characters of the content prefix already streamed
        self._calls_sent = 0
        self.call_ids: list[str] = []

    # -- whole text --

    def _clean(self, text: str) -> str:
        for special in self.specials:
            if special != MISTRAL_MARKER:
                text = text.replace(special, "")
        return text

    def _split(self, text: str) -> tuple[int, int]:
        """(end of the content prefix, start of the tool section); len(text) twice when no section."""
        fmt = self.format
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
        fmt = self.format
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
        fmt = self.format
        if fmt == "llama3_json":  # a call can only start the text
            stripped = text.lstrip()
            return len(text) if not stripped or PYTHON_TAG.startswith(stripped) else 0
        markers = [HERMES_OPEN if fmt == "hermes" else MISTRAL_MARKER]
        markers += self.specials
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
            self.call_ids.append(new_call_id(self.format))
            deltas.append({"index": index, **call.to_openai(self.call_ids[-1])})
        self._calls_sent = max(self._calls_sent, len(calls))
        return content_delta, deltas

    @property
    def num_calls(self) -> int:
        return len(self.call_ids)
