"""Tools for a model whose chat template cannot render them: the definitions go into the system message,
in one documented format (the Hermes / Qwen2.5 one), and the calls are forced by grammar.

Only `tool_choice` "required" or a named function is served this way: the grammar
(api/inference/tools.py `forced_call_grammar`, format "hermes" with the markers as text) guarantees one
call (one only: `parallel_tool_calls` does not apply) that parses, whatever the model knows of tools.
`tool_choice` "auto" stays refused for such models: nothing would make the model's free choice between
text and a call reliable. Answers say `X-Loraserve-Tools: system-prompt`.

The system message gets, after what the caller wrote (or as a new first message):

    # Tools

    You must call one of these functions. Their signatures, one JSON object per line:
    <tools>
    {"type":"function","function":{"name":...,"description":...,"parameters":{...}}}
    </tools>

    Answer with the call only, a JSON object inside <tool_call></tool_call> tags:
    <tool_call>
    {"name":<function name>,"arguments":<arguments object>}
    </tool_call>

Earlier turns are rewritten the same way: an assistant turn's `tool_calls` become `<tool_call>` blocks in
its content, a `tool` turn becomes a `user` turn `<tool_response>\\n...\\n</tool_response>`.
"""

from __future__ import annotations

import json
from typing import Any

TOOLS_HEADER = "X-Loraserve-Tools"
SYSTEM_PROMPT_TOOLS = "system-prompt"

_INTRO = (
    "# Tools\n\nYou must call one of these functions. Their signatures, one JSON object per line:\n<tools>\n"
)
_OUTRO = (
    "\n</tools>\n\nAnswer with the call only, a JSON object inside <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name":<function name>,"arguments":<arguments object>}\n</tool_call>'
)


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    """The tools section of the system message (`tools` in OpenAI's shape, as `template_tools` makes)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False, separators=(",", ":")) for t in tools)
    return _INTRO + lines + _OUTRO


def _call_block(call: dict[str, Any]) -> str:
    function = call["function"]
    body = {"name": function["name"], "arguments": function["arguments"]}
    return "<tool_call>\n" + json.dumps(body, ensure_ascii=False, separators=(",", ":")) + "\n</tool_call>"


def system_prompt_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """`messages` (as `template_messages` makes them) for a template without tools: the tools section in
    the system message, tool calls and tool results as plain text turns."""
    section = tools_system_text(tools)
    out: list[dict[str, Any]] = []
    for message in messages:
        m = dict(message)
        if m.get("tool_calls"):
            blocks = "\n".join(_call_block(c) for c in m.pop("tool_calls"))
            m["content"] = f"{m['content']}\n{blocks}" if m.get("content") else blocks
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        out.append(m)
    if out and out[0]["role"] in ("system", "developer"):
        first = out[0]
        out[0] = {**first, "content": f"{first['content']}\n\n{section}" if first["content"] else section}
    else:
        out.insert(0, {"role": "system", "content": section})
    return out
