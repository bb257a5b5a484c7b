"""Token-level request fields through a real server and the official `openai` client (`extra_body`):
`logit_bias`, `min_tokens`, `allowed_token_ids` against transformers' logits processors (greedy, on
token-id prompts, the tokens read back with `return_tokens_as_token_ids`); `bad_words`,
`truncate_prompt_tokens`; beam search and bad values refused by name (api/inference/logit_fields.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from tests.base_engine.oracle import hf_greedy
from tests.harness.engine_inputs import random_prompts
from tests.harness.families import CHECKPOINTS
from tests.harness.servers import Server, launch_server, main_server_args

pytestmark = pytest.mark.slow  # a real server

MODEL = "tiny-llama"
MAX_NEW = 8


class AllowedIds(LogitsProcessor):
    def __init__(self, allowed: list[int]) -> None:
        self.allowed = torch.tensor(allowed)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(scores, -torch.inf)
        out[:, self.allowed] = scores[:, self.allowed]
        return out


@pytest.fixture(scope="module")
def model_dir(make_checkpoint) -> Path:
    return make_checkpoint(**CHECKPOINTS["llama-gqa"])


@pytest.fixture(scope="module")
def client(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with launch_server(main_server_args(model_dir), tmp_path_factory.mktemp("logit") / "data") as server:
        yield _client(server, server.tenant("logit")[1])


def _client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=120)


def _ids(client: openai.OpenAI, prompt: list[int], **extra) -> tuple[list[int], str]:
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_NEW,
        temperature=0.0,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, **extra},
    )
    tokens = r.choices[0].logprobs.tokens
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.split(":", 1)[1]) for t in tokens], r.choices[0].finish_reason


def test_rules_match_transformers(client, model_dir: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    eos = sorted(set(hf.generation_config.eos_token_id))
    allowed = list(range(40, 70))
    for prompt in random_prompts(2, 500, 4, 10, seed=7):
        plain, _ = _ids(client, prompt, ignore_eos=True)
        cases = [
            ({"logit_bias": {str(plain[0]): -100, "77": 6.5}, "ignore_eos": True},
             [SequenceBiasLogitsProcessor([[[plain[0]], -100.0], [[77], 6.5]])]),
            ({"allowed_token_ids": allowed, "ignore_eos": True}, [AllowedIds(allowed)]),
            # EOS biased to the top: only min_tokens holds it back (bias 500 is clamped to 100).
            ({"logit_bias": {str(eos[0]): 500}, "min_tokens": 3},
             [SequenceBiasLogitsProcessor([[[eos[0]], 100.0]]),
              MinNewTokensLengthLogitsProcessor(len(prompt), 3, eos)]),
        ]  # fmt: skip
        for extra, processors in cases:
            got, reason = _ids(client, prompt, **extra)
            ref, _ = hf_greedy(hf, prompt, MAX_NEW, logits_processor=LogitsProcessorList(processors))
            assert got == ref[: len(got)], extra
            assert got != plain, extra
        assert len(got) == 4 and got[-1] == eos[0] and reason == "stop"


def _bannable(tokenizer, token_id: int) -> str | None:
    """The word whose bad_words entry bans this token (vLLM's encoding: the word, and with one leading
    space when that is one token too)."""
    word = tokenizer.decode([token_id]).strip()
    plain = tokenizer.encode(word, add_special_tokens=False)
    spaced = tokenizer.encode(" " + word, add_special_tokens=False)
    return (
        word if word and len(plain) == 1 and token_id in (plain[0], spaced[0]) and len(spaced) == 1 else None
    )


def test_bad_words_are_not_generated(client, model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = random_prompts(1, 500, 6, 6, seed=3)[0]
    plain, _ = _ids(client, prompt, ignore_eos=True)
    i, word = next((i, w) for i, t in enumerate(plain) if (w := _bannable(tokenizer, t)) is not None)
    got, _ = _ids(client, prompt, ignore_eos=True, bad_words=[word])
    assert got[:i] == plain[:i] and got[i] != plain[i]
    assert plain[i] not in got


def test_truncate_prompt_tokens_keeps_the_last_tokens(client) -> None:
    prompt = random_prompts(1, 500, 20, 20, seed=5)[0]
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0, extra_body={"truncate_prompt_tokens": 6}
    )
    short = client.completions.create(model=MODEL, prompt=prompt[-6:], max_tokens=4, temperature=0.0)
    assert r.usage.prompt_tokens == 6
    assert r.choices[0].text == short.choices[0].text


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"use_beam_search": True}, "use_beam_search", "beam search is not served"),
        ({"length_penalty": 0.5}, "length_penalty", "beam search"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "must be token ids"),
        ({"logit_bias": {"999999": 1}}, "logit_bias", "outside the vocabulary"),
        ({"allowed_token_ids": [1, 999999]}, "allowed_token_ids", "outside the vocabulary"),
        ({"min_tokens": 20}, "min_tokens", "max_tokens"),
        ({"truncate_prompt_tokens": 100000}, "truncate_prompt_tokens", "max_model_len"),
    ],
)
def test_bad_values_are_refused_by_name(client, extra, param, says) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=4, extra_body=extra)
    error = info.value.body
    assert error["param"] == param and says in error["message"], error
