"""vLLM's and OpenAI's token-level request fields -> the engine's logit rules (base_engine/logit_rules.py)
and prompt truncation, each checked up front with a 400 naming the field.

- `logit_bias` (OpenAI): token id (a string key, as JSON has it) -> bias, clamped to [-100, 100] as
  vLLM and the OpenAI spec do; an id outside the vocabulary is a 400.
- `min_tokens`, `allowed_token_ids` (vLLM): as given; ids checked against the vocabulary.
- `bad_words` (vLLM): each word is encoded twice, as vLLM does, so that it is banned both at the start
  of the text and after a space: as written (leading spaces stripped) and with one leading space,
  the second only when it gives as many tokens and a different first token.
- `truncate_prompt_tokens` (vLLM): only the last N prompt tokens are kept (-1: the last max_model_len).
- Beam search (`use_beam_search`, `length_penalty`) is not served: a 400 that says so.
"""

from __future__ import annotations

from typing import Any

from api.errors import APIError
from api.inference.protocol import ChatCompletionRequest, CompletionRequest

MAX_LOGIT_BIAS = 100.0


def refuse_beam_search(body: CompletionRequest | ChatCompletionRequest) -> None:
    """400 for vLLM's beam search fields set to anything but their off values."""
    if body.use_beam_search:
        raise _bad("use_beam_search", "beam search is not served by this server; sample or decode greedily")
    if body.length_penalty not in (None, 1.0):
        raise _bad(
            "length_penalty", "length_penalty applies only to beam search, which this server does not serve"
        )


def logit_rule_options(
    body: CompletionRequest | ChatCompletionRequest, tokenizer: Any, vocab_size: int
) -> dict[str, Any]:
    """SamplingParams' rule fields for the request (empty when it sends none)."""
    options: dict[str, Any] = {}
    if body.min_tokens:
        options["min_tokens"] = body.min_tokens
    if body.allowed_token_ids is not None:
        if not body.allowed_token_ids:
            raise _bad("allowed_token_ids", "allowed_token_ids must not be empty")
        _check_ids("allowed_token_ids", body.allowed_token_ids, vocab_size)
        options["allowed_token_ids"] = list(body.allowed_token_ids)
    if body.bad_words:
        options["bad_words_token_ids"] = bad_words_token_ids(body.bad_words, tokenizer)
        _check_ids("bad_words", [t for w in options["bad_words_token_ids"] for t in w], vocab_size)
    if body.logit_bias:
        options["logit_bias"] = _logit_bias(body.logit_bias, vocab_size)
    return options


def bad_words_token_ids(words: list[str], tokenizer: Any) -> list[list[int]]:
    """vLLM's encoding of `bad_words`: "world" -> [ids of "world"], plus [ids of " world"] when that is
    a different token sequence of the same length."""
    encoded: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise _bad("bad_words", f"bad word {word!r} encodes to no tokens")
        encoded.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            encoded.append(spaced)
    return encoded


def truncate_prompt(
    prompt_ids: list[int], body: CompletionRequest | ChatCompletionRequest, max_model_len: int
) -> list[int]:
    """The last `truncate_prompt_tokens` tokens of the prompt (all of it when the field is absent)."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return prompt_ids
    if keep == -1:
        keep = max_model_len
    if keep > max_model_len:
        raise _bad(
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens ({keep}) must be at most max_model_len ({max_model_len}), or -1",
        )
    return prompt_ids[-keep:]


def _logit_bias(raw: dict[str, float], vocab_size: int) -> dict[int, float]:
    bias = {}
    for key, value in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise _bad("logit_bias", f"logit_bias keys must be token ids (integers), got {key!r}") from None
        bias[token_id] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(value)))
    _check_ids("logit_bias", list(bias), vocab_size)
    return bias


def _check_ids(field: str, ids: list[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise _bad(
            field, f"{field} has token ids outside the vocabulary: {bad[:5]}; expected 0 <= id < {vocab_size}"
        )


def _bad(field: str, message: str) -> APIError:
    return APIError(400, message, param=field, code="invalid_value")
