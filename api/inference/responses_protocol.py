"""`POST /v1/responses` request bodies (OpenAI's Responses API), turned into the chat request they mean,
so that rendering, planning, admission and metering are the chat path's own (api/inference/completions.py).

- `input`: a string (one user message) or items: messages (`role` user/system/developer/assistant,
  `content` a string or `input_text` / `output_text` parts), `function_call` (an earlier call, by
  `call_id`) and `function_call_output` (its result); `instructions` is a system message first.
- `tools`: function tools (`{"type": "function", "name", "description", "parameters", "strict"}`),
  `tool_choice` as on chat (`{"type": "function", "name"}` for a named one).
- `text.format`: `text`, `json_object`, `json_schema` (`name`, `schema`, ...), as chat's `response_format`.
- `store: true` keeps the response per tenant, `previous_response_id` continues from a kept one
  (api/inference/stored_responses.py); omitted `store` (what the official client and the Agents SDK
  send by default) is served unstored, as is `store: false`.
Unknown fields are a 400 naming them, as on chat.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from api.errors import APIError
from api.inference.protocol import ChatCompletionRequest
from registry.models import MAX_USER_CHARS


def _unsupported(field: str, why: str = "") -> PydanticCustomError:
    return PydanticCustomError("unsupported", f"`{field}` is not supported by this server{why}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextConfig(_Strict):
    format: dict[str, Any] | None = None
    verbosity: Literal["medium"] | None = None


class ResponsesRequest(_Strict):
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = Field(None, max_length=MAX_USER_CHARS)
    seed: int | None = None
    truncation: Literal["disabled"] | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    top_logprobs: int | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    allow_json_whitespace: StrictBool | None = None  # ours, as on chat
    speculative: StrictBool | None = None  # ours, as on chat

    @field_validator("include", "reasoning", "top_logprobs")
    @classmethod
    def _empty_only(cls, value: Any, info: Any) -> Any:
        if value and not (info.field_name == "reasoning" and not any(value.values())):
            raise _unsupported(info.field_name)
        return value

    @field_validator("service_tier")
    @classmethod
    def _tier(cls, value: str | None) -> str | None:
        if value not in (None, "auto", "default"):
            raise _unsupported("service_tier")
        return value


def _bad_item(index: int, message: str) -> APIError:
    return APIError(400, f"input[{index}]: {message}", param=f"input[{index}]", code="invalid_value")


def _text_of(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise _bad_item(index, "content must be a string or a list of text parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _bad_item(
                index, f"only text content parts (input_text, output_text) are supported, got {kind}"
            )
        if not isinstance(part.get("text"), str):
            raise _bad_item(index, "a text part needs `text`, a string")
        texts.append(part["text"])
    return "".join(texts)


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's `input` as items (a string is one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return list(body.input)


def _messages(body: ResponsesRequest, earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    for i, item in enumerate([*earlier, *input_items(body)]):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad_item(i, f"role must be user, system, developer or assistant, got {role!r}")
            messages.append({"role": role, "content": _text_of(item.get("content"), i)})
        elif kind == "function_call":
            call = {
                "id": str(item.get("call_id") or item.get("id") or ""),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, i)
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id")), "content": text})
        elif kind == "reasoning":
            continue  # a reasoning item an earlier answer did not make here; nothing to render
        else:
            raise _bad_item(
                i, f"items of type {kind!r} are not supported (message, function_call, function_call_output)"
            )
    return messages


def chat_request(
    body: ResponsesRequest, earlier: list[dict[str, Any]] | None = None
) -> ChatCompletionRequest:
    """The chat completion request a Responses body means (validated like any chat body); `earlier`:
    the stored conversation its `previous_response_id` continues, before its own input."""
    tools = None
    if body.tools:
        tools = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in body.tools
        ]
    choice: Any = body.tool_choice
    if isinstance(choice, NamedFunctionChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.get("type") == "json_schema":  # flat in the Responses API
        spec = {k: v for k, v in fmt.items() if k != "type"}
        fmt = {"type": "json_schema", "json_schema": spec}
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": _messages(body, earlier or []),
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": fmt,
        "stream": bool(body.stream),
        "user": body.user,
        "seed": body.seed,
        "allow_json_whitespace": body.allow_json_whitespace,
        "speculative": body.speculative,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"])
        raise APIError(400, f"{param}: {first['msg']}", param=param, code="invalid_value") from None
