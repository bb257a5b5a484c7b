"""What one request may ask of the shared engine: its fan-out, its stops and its logprobs, each bounded by
a setting (api/settings.py) and refused with a 400 naming the limit before any engine work.

Measured on a live server before these bounds (issue 28):
- one completion with `n=128` (256 tokens, `logprobs=20`) took another tenant's time to first token
  from 0.05 s to 28 s, two prompts x 128 to 51 s, and its answer was 19-46 MB;
- 10,000 stop strings took a co-batched request from 6.5 to 205 ms per token, 800,000 stop token ids
  to 1,242 ms per token.

So `n` x prompts (the engine requests, each a sequence in the batch) is capped at `max_choices`; the
logprob entries one response may carry, choices x `max_tokens` x (top alternatives + the chosen token),
at `max_logprob_entries`; and stops at `max_stop_strings` strings of at most `max_stop_string_chars`
characters and `max_stop_token_ids` ids (OpenAI allows 4 stop sequences). The engine matches them in
time independent of their number anyway (base_engine/stop_strings.py); these bounds keep the work to
compile them, and each request's share of the batch, small.
"""

from __future__ import annotations

from dataclasses import dataclass

from api.errors import APIError
from api.inference.protocol import ChatCompletionRequest, CompletionRequest


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestLimits:
    max_choices: int = 16  # n x prompts per request
    max_logprob_entries: int = 1 << 18  # per response: choices x max_tokens x (top_logprobs + 1)
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 256


def check_fan_out_and_stops(
    body: CompletionRequest | ChatCompletionRequest, *, num_prompts: int, limits: RequestLimits
) -> None:
    """The 400 for a request past the fan-out or stop bounds; known before any prompt is encoded."""
    num_choices = num_prompts * (body.n or 1)
    if num_choices > limits.max_choices:
        what = f"n={body.n or 1} x {num_prompts} prompts" if num_prompts > 1 else f"n={body.n or 1}"
        raise APIError(
            400,
            f"This request asks for {num_choices} choices ({what}); at most {limits.max_choices} "
            f"(n x prompts) are allowed per request.",
            param="n",
            code="invalid_value",
        )
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > limits.max_stop_strings:
        raise APIError(
            400,
            f"stop has {len(stops)} strings; at most {limits.max_stop_strings} are allowed.",
            param="stop",
            code="invalid_value",
        )
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_string_chars:
        raise APIError(
            400,
            f"a stop string is {longest} characters long; at most {limits.max_stop_string_chars} "
            f"are allowed.",
            param="stop",
            code="invalid_value",
        )
    num_ids = len(body.stop_token_ids or [])
    if num_ids > limits.max_stop_token_ids:
        raise APIError(
            400,
            f"stop_token_ids has {num_ids} ids; at most {limits.max_stop_token_ids} are allowed.",
            param="stop_token_ids",
            code="invalid_value",
        )


def check_logprob_entries(
    *, num_top_logprobs: int | None, total_max_tokens: int, limits: RequestLimits, param: str
) -> None:
    """The 400 for a response that could carry more logprob entries than `max_logprob_entries`:
    `total_max_tokens` (over all choices) x (`num_top_logprobs` + 1); nothing to bound without logprobs."""
    if num_top_logprobs is None:
        return
    entries = total_max_tokens * (num_top_logprobs + 1)
    if entries > limits.max_logprob_entries:
        raise APIError(
            400,
            f"This request could return {entries} logprob entries (max_tokens {total_max_tokens} over "
            f"all choices x {num_top_logprobs + 1} per token); at most {limits.max_logprob_entries} are "
            f"allowed per response. Lower n, max_tokens or {param}.",
            param=param,
            code="invalid_value",
        )
