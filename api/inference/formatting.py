"""OpenAI response and stream-chunk shapes (openai/openai-openapi `CreateCompletionResponse`,
`CreateChatCompletionResponse`, `CreateChatCompletionStreamResponse`), built from engine outputs.

Logprobs: completions use the legacy `{tokens, token_logprobs, top_logprobs, text_offset}` object,
chat the `{content: [{token, logprob, bytes, top_logprobs: [...]}]}` list. The engine gives, per
generated token, a dict with the chosen token first and then the top-N alternatives.

Tokens that are part of a UTF-8 character (byte-level BPE pieces such as the first byte of "€", or
`<0xE2>` byte-fallback pieces) decode alone to U+FFFD. Their `bytes` are the token's real bytes, and
their token string is OpenAI's `bytes:\\xe2\\x82` form, so that two such tokens never share a key
of a completions `top_logprobs` dict.
"""

from __future__ import annotations

import codecs
import json
import re
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
    # "abort" and "error" never reach a successful response (api/inference/responses.py turns them into
    # errors).
    return reason if reason in (None, "stop", "length", "tool_calls") else "stop"


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1)]
    printable += range(ord("\u00ae"), ord("\u00ff") + 1)
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_decoder()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return False
    return '"ByteLevel"' in decoder.__getstate__().decode("utf-8", "replace")


def token_bytes(tokenizer: Any, token_id: int, is_byte_level: bool) -> bytes:
    """The bytes token `token_id` adds to the output: its byte-level or byte-fallback piece undone,
    else (special tokens, other vocabularies) its decoded text."""
    if token_id not in tokenizer.added_tokens_decoder:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if is_byte_level and all(c in _BYTE_LEVEL for c in piece):
                return bytes(_BYTE_LEVEL[c] for c in piece)
            match = _BYTE_FALLBACK.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
    return tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")


def _token_text(text: str, raw: bytes) -> str:
    """The token's text; `bytes:\\x..` when its bytes are not whole UTF-8 characters (OpenAI's form)."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text


def _top(entries: dict[int, float], num_top: int) -> list[tuple[int, float]]:
    return sorted(entries.items(), key=lambda kv: kv[1], reverse=True)[:num_top]


class LogprobFormatter:
    """Token strings and bytes via the tokenizer, cached per id (the same ids recur across steps)."""

    def __init__(self, tokenizer: Any, num_top: int, *, as_token_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.num_top = num_top
        self.as_token_ids = as_token_ids  # vLLM's return_tokens_as_token_ids: "token_id:N" strings
        self._is_byte_level = _is_byte_level(tokenizer)
        self._text: dict[int, tuple[str, str, bytes]] = {}  # id -> (token string, decoded text, bytes)

    def _lookup(self, token_id: int) -> tuple[str, str, bytes]:
        if token_id not in self._text:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            raw = token_bytes(self.tokenizer, token_id, self._is_byte_level)
            token = f"token_id:{token_id}" if self.as_token_ids else _token_text(text, raw)
            self._text[token_id] = (token, text, raw)
        return self._text[token_id]

    def token(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def text(self, token_id: int) -> str:
        """The token decoded alone (special tokens kept)."""
        return self._lookup(token_id)[1]

    def completion(
        self, token_ids: list[int], logprobs: list[dict[int, float]], text_offset: int = 0
    ) -> dict[str, Any]:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        chars = codecs.getincrementaldecoder("utf-8")("replace")  # a character counts where it ends
        for token_id, entries in zip(token_ids, logprobs, strict=False):
            token, _, raw = self._lookup(token_id)
            tokens.append(token)
            token_logprobs.append(entries[token_id])
            top_logprobs.append({self.token(t): lp for t, lp in _top(entries, self.num_top)})
            offsets.append(text_offset)
            text_offset += len(chars.decode(raw))
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
        token, _, raw = self._lookup(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(raw)}


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
    index: int,
    text: str,
    reason: str | None,
    logprobs: dict[str, Any] | None,
    stop_reason: str | int | None = None,
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason(reason),
        "stop_reason": stop_reason,  # vLLM's: the stop string or stop token id that ended it
    }


def chat_choice(
    index: int,
    text: str | None,
    reason: str | None,
    logprobs: dict[str, Any] | None,
    tool_calls: list[dict[str, Any]] | None = None,
    stop_reason: str | int | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason(reason),
        "stop_reason": stop_reason,
    }


def chunk_body(
    ctx: RequestContext, choices: list[dict[str, Any]], *, include_usage: bool, usage: Usage | None = None
) -> dict[str, Any]:
    """`usage`: the usage so far (vLLM's continuous_usage_stats), else null as the spec has it on
    every chunk but the last."""
    body: dict[str, Any] = {
        "id": ctx.request_id,
        "object": _OBJECTS[ctx.kind][1],
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
    }
    if include_usage:
        body["usage"] = usage.to_dict() if usage is not None else None
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
    stop_reason: str | int | None = None,
) -> dict[str, Any]:
    if ctx.kind == "completion":
        return completion_choice(index, text, reason, logprobs, stop_reason)
    delta: dict[str, Any] = {"role": "assistant", "content": text} if role else {}
    if text and not role:
        delta["content"] = text
    if tool_calls:
        delta["tool_calls"] = tool_calls
    return {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason(reason),
        "stop_reason": stop_reason,
    }
