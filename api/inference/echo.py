"""`echo` on `/v1/completions` (OpenAI's legacy field): each choice's text starts with its prompt.

A string prompt is echoed as sent; a token-id prompt, or one that `truncate_prompt_tokens` cut, as
the text of the ids the model saw (special tokens kept, as vLLM decodes it). Streamed, the prompt
leads each choice's first chunk.

With `logprobs: N` the legacy logprobs object starts with the prompt's tokens (OpenAI's layout: the
first token's logprob and top_logprobs are null), from the engine's prompt logprobs (top N, as vLLM
asks for them); `text_offset` counts in the echoed text, where a BOS the tokenizer added to a string
prompt takes no characters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from api.inference.formatting import LogprobFormatter
from api.inference.protocol import CompletionRequest
from api.inference.sampling import completion_prompts
from base_engine.outputs import PromptTokenLogprobs


@dataclass(frozen=True, slots=True)
class EchoPrompt:
    text: str  # what the prompt's choices start with
    is_bos_silent: bool  # its first token is a BOS the tokenizer added: not in `text`


def echo_prompts(
    body: CompletionRequest, encoded: list[list[int]], run: list[list[int]], tokenizer: Any
) -> list[EchoPrompt] | None:
    """Per prompt, what its choices start with; None without `echo`.

    `encoded`: each prompt's token ids as encoded; `run`: as the engine runs them (after
    `truncate_prompt_tokens`), in the order of `completion_prompts`."""
    if not body.echo:
        return None
    prompts = []
    bos = getattr(tokenizer, "bos_token_id", None)
    for item, ids, kept in zip(completion_prompts(body), encoded, run, strict=True):
        if isinstance(item, str) and len(kept) == len(ids):
            silent = bos is not None and kept[0] == bos and not item.startswith(tokenizer.decode([bos]))
            prompts.append(EchoPrompt(item, silent))
        else:
            prompts.append(EchoPrompt(tokenizer.decode(kept, skip_special_tokens=False), False))
    return prompts


def echo_logprobs(
    formatter: LogprobFormatter,
    echo: EchoPrompt,
    prompt_ids: list[int],
    prompt_logprobs: list[PromptTokenLogprobs | None],
    generated: dict[str, Any] | None,
) -> dict[str, Any]:
    """The legacy logprobs object of an echoed choice: the prompt's tokens, then `generated`'s (whose
    `text_offset`s already count from the end of the echoed text)."""
    first = prompt_ids[0]
    offset = 0 if echo.is_bos_silent else len(formatter.text(first))
    rest = [e.logprobs for e in prompt_logprobs[1:] if e is not None]
    body = formatter.completion(prompt_ids[1:], rest, offset)
    merged = {
        "tokens": [formatter.token(first), *body["tokens"]],
        "token_logprobs": [None, *body["token_logprobs"]],
        "top_logprobs": [None, *body["top_logprobs"]],
        "text_offset": [0, *body["text_offset"]],
    }
    for key in merged if generated is not None else ():
        merged[key] += generated[key]  # type: ignore[index]
    return merged
