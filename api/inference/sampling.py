"""From an OpenAI request body to prompt token ids and engine `SamplingParams`, validated up front.

Everything here raises `APIError(400)` naming the field, before any engine work and before the 200 of
a stream. Context length follows vLLM/OpenAI: prompt + max_tokens must fit in max_model_len
("This model's maximum context length is N tokens..."); an omitted `max_tokens` means "the rest of
the context" on chat (OpenAI's behaviour) and 16 on completions (the OpenAI spec's default). A text
too long to fit whatever it encodes to is refused before it is encoded (`refuse_unfittable_text`).

Sampling fields a request leaves out take the checkpoint's `generation_config.json` values, as vLLM
does by default (`--generation-config auto`): temperature, top_p, top_k, min_p, repetition_penalty,
each only where it differs from transformers' GenerationConfig default (vLLM reads the file's
`to_diff_dict()`), then SamplingParams' own defaults. An adapter's own defaults
(api/inference/adapter_defaults.py) come before the checkpoint's.

Seeds and `deterministic`: every request runs with a seed; one that sends none gets one drawn
by the server (63 bits, `SeedSource`: HMAC-SHA256 of the request id under the server secret, with
`--seed` mixed into the key), reported in its provenance header and usage record, so any sampled answer
can be replayed. No counter is shared between requests, so a tenant learns nothing from its seeds about
other tenants' requests or seeds. A seeded
request's number for each token is a pure function of its seed and the token's position
(base_engine/seeded_uniform.py: two splitmix64 rounds in Python, a few us per sampled row and step);
greedy rows never draw. `deterministic: true` asks for batch-invariant kernels; a server started with
`--deterministic` runs every request so, and a request's `deterministic: false` is then accepted and
overruled (the header says `deterministic=?1`): nobody is harmed by an answer that is reproducible, and
clients that always send the field keep working.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

from api.errors import APIError
from api.inference.prompt_logprobs import engine_prompt_logprobs
from api.inference.protocol import ChatCompletionRequest, CompletionRequest
from api.inference.tools import ToolPlan, template_messages, template_tools
from base_engine.model.token_bound import least_tokens
from base_engine.model.tokenizer import render_chat
from base_engine.sampling_params import SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# generation_config.json keys a request may leave to the checkpoint, with transformers' defaults
# (a value equal to its default is not a default of the checkpoint's: vLLM's `to_diff_dict()`).
GENERATION_DEFAULT_KEYS: dict[str, float | int | None] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 50,
    "min_p": None,
    "repetition_penalty": 1.0,
}
_SEED_SPAN = 1 << 63


@functools.lru_cache(maxsize=16)
def generation_defaults(model_dir: Path) -> dict[str, float | int]:
    """The checkpoint's sampling defaults from `model_dir/generation_config.json` (empty without one)."""
    path = Path(model_dir) / "generation_config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    return {
        k: raw[k]
        for k, hf_default in GENERATION_DEFAULT_KEYS.items()
        if isinstance(raw.get(k), int | float) and not isinstance(raw.get(k), bool) and raw[k] != hf_default
    }


def derive_seed(seed: int | None, index: int) -> int | None:
    """Seed of choice `index`: the request's seed for choice 0, distinct reproducible seeds after it."""
    if seed is None or index == 0:
        return seed
    return (seed + index) % _SEED_SPAN


class SeedSource:
    """The seeds of requests that send none: HMAC-SHA256(key, request id) truncated to 63 bits, the key
    being the server secret with the server's `seed` setting mixed in. Unpredictable without the secret,
    the same for the same secret, seed and request id (a fleet's replicas share the secret, so a request
    retried on another replica under its id keeps its seed), and stateless: nothing is shared between
    requests. An answer replays from the seed its provenance and usage record report."""

    def __init__(self, server_secret: str, seed: int = 0) -> None:
        self._key = hashlib.sha256(f"loraserve-seed:{seed}:{server_secret}".encode()).digest()

    def draw(self, request_id: str) -> int:
        digest = hmac.new(self._key, request_id.encode(), hashlib.sha256).digest()
        return int.from_bytes(digest[:8], "big") >> 1  # 63 bits


def request_seed(body: CompletionRequest | ChatCompletionRequest, seeds: SeedSource, request_id: str) -> int:
    """The seed of the request's first choice: the one it sent, else the one drawn for its id."""
    return body.seed if body.seed is not None else seeds.draw(request_id)


def completion_prompts(body: CompletionRequest) -> list[Any]:
    """The prompts of a completion: a string, a list of strings, token ids, or a list of token-id lists."""
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def encode_completion_prompts(engine: Any, body: CompletionRequest) -> list[list[int]]:
    """Token ids of each prompt (`completion_prompts`)."""
    items = completion_prompts(body)
    if not items:
        raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    for item in items:  # all before any is encoded
        if isinstance(item, str) and body.truncate_prompt_tokens is None:  # a truncated prompt may be long
            refuse_unfittable_text(engine.tokenizer, item, engine.max_model_len, "prompt")
    encoded = []
    for item in items:
        try:
            ids = engine.encode_prompt(item)
        except ValueError as exc:
            raise APIError(400, f"invalid prompt: {exc}", param="prompt", code="invalid_value") from None
        if not ids:
            raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
        encoded.append(ids)
    return encoded


def encode_chat_prompt(
    tokenizer: Any, body: ChatCompletionRequest, tools: ToolPlan | None, max_model_len: int
) -> list[int]:
    """The rendered chat; with a tool plan, `tools` and tool turns go through the template too. The
    template writes BOS itself: nothing is added."""
    messages = developer_as_system(template_messages(body, tools), tokenizer)
    kwargs = {"tools": template_tools(tools)} if tools is not None else {}
    try:
        text = render_chat(tokenizer, messages, variables=body.chat_template_kwargs, **kwargs)
    except ValueError as exc:
        raise template_error(exc, body.chat_template_kwargs) from None
    if body.truncate_prompt_tokens is None:  # a truncated prompt may be long
        refuse_unfittable_text(tokenizer, text, max_model_len, "messages")
    return list(tokenizer.encode(text, add_special_tokens=False))


def developer_as_system(messages: list[dict[str, Any]], tokenizer: Any) -> list[dict[str, Any]]:
    """OpenAI's `developer` role renders as `system` when the chat template names no developer role, as
    OpenAI and vLLM do."""
    template = getattr(tokenizer, "chat_template", None)
    if "developer" in (template if isinstance(template, str) else json.dumps(template)):
        return messages
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


def template_error(exc: ValueError, variables: dict[str, Any] | None) -> APIError:
    """The 400 for a chat the template would not render; with caller variables, they are named too."""
    if not variables:
        return APIError(400, str(exc), param="messages", code="invalid_value")
    message = f"{exc} (with chat_template_kwargs {sorted(variables)})"
    return APIError(400, message, param="chat_template_kwargs", code="invalid_value")


def refuse_unfittable_text(tokenizer: Any, text: str, max_model_len: int, param: str) -> None:
    """400 for a text that encodes to more than max_model_len tokens whatever its content, decided from
    its length (base_engine/model/token_bound.py) before the tokenizer spends seconds on it: the answer it
    would get after encoding, but the count it names is a lower bound."""
    least = least_tokens(tokenizer, text)
    if least > max_model_len:
        what = "prompt" if param == "prompt" else "chat as its template renders it"
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, the {what} is "
            f"{len(text)} characters long, which is at least {least} tokens. Please reduce the length "
            f"of the {param}.",
            param=param,
            code="context_length_exceeded",
        )


def _max_tokens(body: CompletionRequest | ChatCompletionRequest, num_prompt: int, max_model_len: int) -> int:
    is_chat = isinstance(body, ChatCompletionRequest)
    asked, asked_param = body.max_tokens, "max_tokens"
    if is_chat and body.max_completion_tokens is not None:  # it wins when given, whatever its value
        asked, asked_param = body.max_completion_tokens, "max_completion_tokens"
    if asked is not None and asked < 1:  # as the protocol's own check: 0 is a 400, never "absent"
        raise APIError(
            400, f"{asked_param} must be at least 1, got {asked}", param=asked_param, code="invalid_value"
        )
    param = "messages" if is_chat else "prompt"
    remaining = max_model_len - num_prompt
    if asked is None:
        if remaining >= 1:
            return remaining if is_chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, remaining)
        asked = 1
    if num_prompt + asked > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt + asked} tokens ({num_prompt} in the {param}, {asked} in the completion). "
            f"Please reduce the length of the {param} or completion.",
            param=param,
            code="context_length_exceeded",
        )
    return asked


def _logprobs(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    if isinstance(body, CompletionRequest):
        return body.logprobs
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs", code="invalid_value")
    return (body.top_logprobs or 0) if body.logprobs else None


def check_stream_options(body: CompletionRequest | ChatCompletionRequest) -> bool:
    """Whether the stream ends with a usage chunk; stream_options without stream is refused (as vLLM)."""
    if body.stream_options is not None and not body.stream:
        raise APIError(
            400,
            "`stream_options` can only be defined when `stream=True`.",
            param="stream_options",
            code="invalid_value",
        )
    include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
    if body.stream_options is not None and body.stream_options.continuous_usage_stats and not include_usage:
        # vLLM ignores it then; here it would change nothing, so it is refused rather than ignored.
        raise APIError(
            400,
            "`stream_options.continuous_usage_stats` needs `stream_options.include_usage: true`.",
            param="stream_options.continuous_usage_stats",
            code="invalid_value",
        )
    return include_usage


def sampling_params(
    body: CompletionRequest | ChatCompletionRequest,
    *,
    num_prompt: int,
    max_model_len: int,
    index: int,
    defaults: dict[str, float | int] | None = None,
    constraint: Any = None,
    keep_special_tokens: bool = False,
    seed: int | None = None,
    deterministic: bool = False,
    rules: dict[str, Any] | None = None,
) -> SamplingParams:
    """The engine's parameters for choice `index` of a prompt of `num_prompt` tokens.

    `seed`: the request's seed (`request_seed`; None = the body's own); `deterministic`: the server
    runs every request batch-invariant (`--deterministic`), whatever the body says.

    `defaults`: the checkpoint's sampling defaults (`generation_defaults`) for fields the body omits.

    `constraint`: this choice's own grammar matcher (api/inference/structured_outputs.py);
    `keep_special_tokens`:
    the text keeps special tokens (a tool-call marker that is one), whatever the request asked.

    `rules`: the request's logit rules (api/inference/logit_fields.py: `logit_rule_options`)."""
    options: dict[str, Any] = {
        "max_tokens": _max_tokens(body, num_prompt, max_model_len),
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
        "seed": derive_seed(body.seed if seed is None else seed, index),
        "stop": body.stop,
        "stop_token_ids": body.stop_token_ids,
        "ignore_eos": body.ignore_eos,
        "logprobs": _logprobs(body),
        "prompt_logprobs": engine_prompt_logprobs(body),
        "skip_special_tokens": False if keep_special_tokens else body.skip_special_tokens,
        "spaces_between_special_tokens": body.spaces_between_special_tokens,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "constraint": constraint,
        "deterministic": deterministic or bool(body.deterministic),
        "speculative": body.speculative,
        **(rules or {}),
    }
    for key, value in (defaults or {}).items():
        if options.get(key) is None:
            options[key] = value
    try:
        return SamplingParams(**{k: v for k, v in options.items() if v is not None})
    except ValueError as exc:
        field = str(exc).split(" ", 1)[0]
        raise APIError(
            400, str(exc), param=field if field in options else None, code="invalid_value"
        ) from None
