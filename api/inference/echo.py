"""`echo` on `/v1/completions` (OpenAI's legacy field): each choice's text starts with its prompt.

A string prompt is echoed as sent; a token-id prompt, or one that `truncate_prompt_tokens` cut, as
the text of the ids the model saw (special tokens kept, as vLLM decodes it). Streamed, the prompt
leads each choice's first chunk.
"""

from __future__ import annotations

from typing import Any

from api.errors import APIError
from api.inference.protocol import CompletionRequest
from api.inference.sampling import completion_prompts


def echo_texts(
    body: CompletionRequest, encoded: list[list[int]], run: list[list[int]], tokenizer: Any
) -> list[str] | None:
    """Per prompt, the text its choices start with; None without `echo`.

    `encoded`: each prompt's token ids as encoded; `run`: as the engine runs them (after
    `truncate_prompt_tokens`), in the order of `completion_prompts`."""
    if not body.echo:
        return None
    if body.logprobs is not None:
        raise APIError(
            400,
            "`echo` with `logprobs` is not supported yet (the prompt's logprobs are not computed)",
            param="echo",
            code="unsupported_value",
        )
    texts = []
    for item, ids, kept in zip(completion_prompts(body), encoded, run, strict=True):
        if isinstance(item, str) and len(kept) == len(ids):
            texts.append(item)
        else:
            texts.append(tokenizer.decode(kept, skip_special_tokens=False))
    return texts
