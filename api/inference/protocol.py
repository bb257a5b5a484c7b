"""Request bodies of the OpenAI endpoints (openai/openai-openapi `CreateCompletionRequest`,
`CreateChatCompletionRequest`) plus vLLM's sampling extensions (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens`, `spaces_between_special_tokens`,
`include_stop_str_in_output`, `chat_template_kwargs`, `min_tokens`, `allowed_token_ids`, `bad_words`,
`truncate_prompt_tokens`, `return_tokens_as_token_ids`; OpenAI's `logit_bias`: api/inference/logit_fields.py)
and our `deterministic` (batch-invariant,
api/inference/sampling.py).

Unknown fields are refused (`extra="forbid"` -> 400 "Unrecognized request argument supplied: x"),
as OpenAI does and vLLM does not. Fields OpenAI defines but this server does not implement are
declared so that their defaults pass and any other value is refused naming the field: nothing
is silently ignored. Cross-field rules (stream_options without stream, context length) live in
api/inference/sampling.py, where the error can name the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue, StrictBool, field_validator
from pydantic_core import PydanticCustomError

from adapters.files import json_depth
from base_engine.model.tokenizer import check_template_variables
from registry.models import MAX_USER_CHARS
from registry.types import PRIORITY_MAX, PRIORITY_MIN

MAX_LOGPROBS = 20  # vLLM's cap; OpenAI allows 5 (completions) and 20 (chat)
# Nesting of `chat_template_kwargs` (real ones are flat flags such as Qwen3's enable_thinking); the
# render copies the values recursively, so a value nested some hundreds deep would exhaust the stack.
MAX_TEMPLATE_KWARGS_DEPTH = 16


def _template_kwargs(value: dict[str, JsonValue] | None) -> dict[str, JsonValue] | None:
    if value:
        if json_depth(value, MAX_TEMPLATE_KWARGS_DEPTH) > MAX_TEMPLATE_KWARGS_DEPTH:
            raise ValueError(f"nests deeper than the limit of {MAX_TEMPLATE_KWARGS_DEPTH} levels")
        check_template_variables(value)
    return value


# vLLM's `chat_template_kwargs`: an object of JSON values, extra variables for the chat template.
TemplateKwargs = Annotated[dict[str, JsonValue] | None, AfterValidator(_template_kwargs)]


def _unsupported(field: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", f"`{field}` is not supported by this server")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage so far on every chunk (with include_usage)
    include_obfuscation: bool | None = None

    @field_validator("include_obfuscation")
    @classmethod
    def _off(cls, value: bool | None, info: Any) -> bool | None:
        if value:
            raise _unsupported(f"stream_options.{info.field_name}")
        return value


class _SamplingFields(_Strict):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    user: str | None = Field(None, max_length=MAX_USER_CHARS)  # stored with the usage record
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: StrictBool | None = None  # base_engine/detokenizer.py
    include_stop_str_in_output: bool | None = None
    # Batch-invariant execution: true or false only ("yes", 1 -> 400 naming the field).
    deterministic: StrictBool | None = None
    # Ours: false opts this request out of speculative decoding (its tokens are the same either way).
    speculative: StrictBool | None = None
    # vLLM's priority (lower = more urgent); default and most urgent allowed: the tenant's
    # (api/tenancy/priority.py)
    priority: int | None = Field(None, ge=PRIORITY_MIN, le=PRIORITY_MAX, strict=True)
    # OpenAI's logit_bias and vLLM's token-level fields (api/inference/logit_fields.py)
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = Field(None, ge=0)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    return_tokens_as_token_ids: bool | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # api/inference/prompt_logprobs.py
    # vLLM's structured output fields (api/inference/guided.py)
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    use_beam_search: bool | None = None  # refused when true: beam search is not served
    length_penalty: float | None = None  # beam search only: refused unless 1.0
    # Ours: constrained JSON (response_format, forced tool calls) may have whitespace between tokens;
    # by default it is compact (api/inference/structured_outputs.py).
    allow_json_whitespace: StrictBool | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None  # the prompt leads each choice's text (api/inference/echo.py)
    best_of: int | None = None
    suffix: str | None = None
    response_format: dict[str, Any] | None = None  # as on chat (a vLLM extension here)

    @field_validator("best_of", "suffix")
    @classmethod
    def _refused(cls, value: Any, info: Any) -> Any:
        if value not in (None, False):
            raise _unsupported(info.field_name)
        return value


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; omitted = no arguments
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(_Strict):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this result answers
    refusal: str | None = None  # echoed back by clients that resend a response's message

    @field_validator("content")
    @classmethod
    def _text_only(cls, value: str | list[dict[str, Any]] | None) -> str:
        """Content parts are joined into one string; only `{"type": "text", "text": ...}` parts exist here."""
        if value is None or isinstance(value, str):
            return value or ""
        texts = []
        for part in value:
            if (
                part.get("type") != "text"
                or not isinstance(part.get("text"), str)
                or set(part) - {"type", "text"}
            ):
                raise PydanticCustomError(
                    "unsupported",
                    "only text content parts ('type': 'text') are supported, got {part}",
                    {"part": str(part)[:100]},
                )
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    metadata: dict[str, str] | None = None  # bookkeeping only: stored nowhere, changes nothing
    store: bool | None = None
    service_tier: str | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None  # checked in api/inference/structured_outputs.py
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: str | None = None
    web_search_options: Any = None
    chat_template_kwargs: TemplateKwargs = None

    @field_validator(
        "store",
        "service_tier",
        "functions",
        "function_call",
        "modalities",
        "audio",
        "prediction",
        "reasoning_effort",
        "web_search_options",
    )
    @classmethod
    def _refused(cls, value: Any, info: Any) -> Any:
        no_op = {
            "store": (None, False),
            "service_tier": (None, "auto", "default"),
            "functions": (None, []),
            "modalities": (None, ["text"]),
        }.get(info.field_name, (None,))
        if value not in no_op:
            raise _unsupported(info.field_name)
        return value
