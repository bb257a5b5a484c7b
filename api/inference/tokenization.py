"""`/tokenize` and `/detokenize` as vLLM serves them (`vllm/entrypoints/openai/protocol.py`
`TokenizeCompletionRequest`, `TokenizeChatRequest`, `DetokenizeRequest`).

`model` is resolved exactly as for completions (the base model or the caller's own adapter; anything
else is the same 404), so a tenant learns nothing here it could not learn from `/v1/models`. Adapters
share the base model's tokenizer, so the tokens are the same for both. A chat is rendered by the
same code as `/v1/chat/completions` (message `name`, tool calls and `tools` included).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.orm import Session

from api.context import Caller
from api.errors import APIError
from api.inference.planning import resolve_model
from api.inference.protocol import ChatCompletionRequest, ChatMessage, TemplateKwargs, ToolDefinition
from api.inference.sampling import refuse_unfittable_text, template_error
from api.inference.tools import plan_tools, template_messages, template_tools
from base_engine.async_engine import AsyncEngine
from base_engine.model.tokenizer import render_chat


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizeCompletionRequest(_Strict):
    model: str = Field(min_length=1)
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes BOS itself
    return_token_strs: bool = False
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: TemplateKwargs = None


class DetokenizeRequest(_Strict):
    model: str = Field(min_length=1)
    tokens: list[int]


def _token_ids(engine: AsyncEngine, body: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
    tokenizer = engine.tokenizer
    if isinstance(body, TokenizeCompletionRequest):
        refuse_unfittable_text(tokenizer, body.prompt, engine.max_model_len, "prompt")
        return list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
    if body.continue_final_message and body.add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
            code="invalid_value",
        )
    chat = ChatCompletionRequest(model=body.model, messages=body.messages, tools=body.tools)
    tools = plan_tools(chat, tokenizer)
    kwargs: dict[str, Any] = {"tools": template_tools(tools)} if tools is not None else {}
    if body.continue_final_message:
        kwargs["continue_final_message"] = True
    try:
        text = render_chat(
            tokenizer,
            template_messages(chat, tools),
            add_generation_prompt=body.add_generation_prompt,
            variables=body.chat_template_kwargs,
            **kwargs,
        )
    except ValueError as exc:
        raise template_error(exc, body.chat_template_kwargs) from None
    refuse_unfittable_text(tokenizer, text, engine.max_model_len, "messages")
    return list(tokenizer.encode(text, add_special_tokens=body.add_special_tokens))


def tokenize(
    *,
    engine: AsyncEngine,
    model_name: str,
    session: Session,
    caller: Caller,
    body: TokenizeCompletionRequest | TokenizeChatRequest,
) -> dict[str, Any]:
    resolve_model(model_name=model_name, session=session, caller=caller, model=body.model)
    ids = _token_ids(engine, body)
    strs = engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(
    *, engine: AsyncEngine, model_name: str, session: Session, caller: Caller, body: DetokenizeRequest
) -> dict[str, Any]:
    resolve_model(model_name=model_name, session=session, caller=caller, model=body.model)
    vocab_size = engine.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise APIError(
            400,
            f"token ids must be in [0, {vocab_size}), got {bad[:5]}",
            param="tokens",
            code="invalid_value",
        )
    return {"prompt": engine.tokenizer.decode(body.tokens)}
