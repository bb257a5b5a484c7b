"""OpenAI response and stream-chunk shapes (openai/openai-openapi `CreateCompletionResponse`,
`CreateChatCompletionResponse`, `CreateChatCompletionStreamResponse`), built from engine outputs.

Logprobs: completions use the legacy `{tokens, token_logprobs, top_logprobs, text_offset}` object,
chat the `{content: [{token, logprob, bytes, top_logprobs: [...]}]}` list. The engine gives, per
generated token, a dict with the chosen token first and then the top-N alternatives.
"""

from __future__ import annotations

import json
from typing import Any

from api.context import RequestContext, Usage

_OBJECTS = {
    "completion": ("text_completion", "text_completion"),
    "chat": ("chat.completion", "chat.completion.chunk"),
}


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def finish_reason(reason: str | None) -> str | None:
    # "abort" and "error" never reach a successful response (api/responses.py turns them into errors).
    return reason if reason in (None, "stop", "length", "tool_calls") else "stop"


def _top(entries: dict[int, float], num_top: int) -> list[tuple[int, float]]:
    return sorted(entries.items(), key=lambda kv: kv[1], reverse=True)[:num_top]


class LogprobFormatter:
    """Token strings via the tokenizer, cached per id (the same ids recur across steps)."""

    def __init__(self, tokenizer: Any, num_top: int) -> None:
        self.tokenizer = tokenizer
        self.num_top = num_top
        self._text: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        if token_id not in self._text:
            self._text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self._text[token_id]

    def completion(
        self, token_ids: list[int], logprobs: list[dict[int, float]], text_offset: int = 0
    ) -> dict[str, Any]:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, entries in zip(token_ids, logprobs, strict=False):
            text = self.token(token_id)
            tokens.append(text)
            token_logprobs.append(entries[token_id])
            top_logprobs.append({self.token(t): lp for t, lp in _top(entries, self.num_top)})
            offsets.append(text_offset)
            text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def chat(self, token_ids: list[int], logprobs: list[dict[int, float]]) -> dict[str, Any]:
        content = []
        for token_id, entries in zip(token_ids, logprobs, strict=False):
            content.append(
                {
                    **self._entry(token_id, entries[token_id]),
                    "top_logprobs": [self._entry(t, lp) for t, lp in _top(entries, self.num_top)],
                }
            )
        return {"content": content}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def response_body(ctx: RequestContext, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
    return {
        "id": ctx.request_id,
        "object": _OBJECTS[ctx.kind][0],
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
        "usage": usage.to_dict(),
    }


def completion_choice(
    index: int, text: str, reason: str | None, logprobs: dict[str, Any] | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(reason)}


def chat_choice(
    index: int,
    text: str | None,
    reason: str | None,
    logprobs: dict[str, Any] | None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason(reason),
    }


def chunk_body(ctx: RequestContext, choices: list[dict[str, Any]], *, include_usage: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": ctx.request_id,
        "object": _OBJECTS[ctx.kind][1],
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
    }
    if include_usage:
        body["usage"] = None  # the spec: null on every chunk but the last
    return body


def usage_chunk(ctx: RequestContext, usage: Usage) -> dict[str, Any]:
    body = chunk_body(ctx, [], include_usage=False)
    body["usage"] = usage.to_dict()
    return body


def chunk_choice(
    ctx: RequestContext,
    index: int,
    text: str,
    reason: str | None,
    logprobs: dict[str, Any] | None,
    *,
    role: bool = False,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    if ctx.kind == "completion":
        return completion_choice(index, text, reason, logprobs)
    delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {}
    if text and not role:
        delta["content"] = text
    if tool_calls:
        delta["tool_calls"] = tool_calls
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
