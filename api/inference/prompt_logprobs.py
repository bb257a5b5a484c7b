"""vLLM's `prompt_logprobs: N` (completions and chat): per prompt token, its logprob, rank and
decoded text plus the top-N alternatives', under the model given the tokens before it; the first
token has none (null). Completions carry them per choice, chat once beside `choices`, both in vLLM's
layout (`{"<token id>": {"logprob", "rank", "decoded_token"}}`). As in vLLM, not with `stream`.

The engine scores every prompt position (base_engine/prompt_logprobs.py: the request skips the prefix
cache). `echo` with `logprobs` asks it for the prompt's logprobs too (api/inference/echo.py); the
engine then scores the larger of the two N.
"""

from __future__ import annotations

from typing import Any

from api.errors import APIError
from api.inference.formatting import LogprobFormatter
from api.inference.limits import RequestLimits
from api.inference.protocol import ChatCompletionRequest, CompletionRequest
from base_engine.outputs import PromptTokenLogprobs


def engine_prompt_logprobs(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The top-N the engine scores per prompt token: `prompt_logprobs`, or `logprobs` with `echo`."""
    echoed = body.logprobs if isinstance(body, CompletionRequest) and body.echo else None
    if body.prompt_logprobs is None and echoed is None:
        return None
    return max(body.prompt_logprobs or 0, echoed or 0)


def check_prompt_logprobs(
    body: CompletionRequest | ChatCompletionRequest, *, num_prompt_tokens: int, limits: RequestLimits
) -> None:
    """400s before any engine work: with `stream` (as vLLM), and past the response's logprob bound."""
    if body.prompt_logprobs is not None and body.stream:
        raise APIError(
            400, "`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs",
            code="invalid_value",
        )  # fmt: skip
    top = engine_prompt_logprobs(body)
    if top is None:
        return
    entries = num_prompt_tokens * (body.n or 1) * (top + 1)
    if entries > limits.max_logprob_entries:
        raise APIError(
            400,
            f"This request could return {entries} prompt logprob entries ({num_prompt_tokens} prompt "
            f"tokens x n x {top + 1} per token); at most {limits.max_logprob_entries} are allowed per "
            "response. Lower n, the prompt's length or prompt_logprobs.",
            param="prompt_logprobs" if body.prompt_logprobs is not None else "logprobs",
            code="invalid_value",
        )


def vllm_prompt_logprobs(
    formatter: LogprobFormatter, entries: list[PromptTokenLogprobs | None], num_top: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's layout: per prompt token, its own entry and the `num_top` best alternatives', by id."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        token, own = next(iter(entry.logprobs.items()))
        others = sorted(((t, lp) for t, lp in entry.logprobs.items() if t != token), key=lambda x: -x[1])
        row = {str(token): _logprob(formatter, token, own, entry.rank)}
        for i, (t, lp) in enumerate(others[:num_top]):
            # The alternatives are the top N in order; the prompt token counts above them where it is.
            row[str(t)] = _logprob(formatter, t, lp, i + 1 + (own > lp))
        out.append(row)
    return out


def _logprob(formatter: LogprobFormatter, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": formatter.token(token_id)}
