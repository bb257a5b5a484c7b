"""Logit rules (base_engine/logit_rules.py) against transformers' own logits processors, greedy, on a tiny
checkpoint: allowed_token_ids (a custom processor), bad words (`NoBadWordsLogitsProcessor`), min_tokens
(`MinNewTokensLengthLogitsProcessor`) and logit_bias (`SequenceBiasLogitsProcessor`, before the
repetition penalty as in vLLM); stop strings wait for min_tokens (the detokenizer)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from base_engine import LLM, SamplingParams
from base_engine.detokenizer import Detokenizer
from tests.base_engine.oracle import assert_greedy_match, hf_greedy
from tests.harness.engine_inputs import random_prompts
from tests.harness.families import CHECKPOINTS

MAX_NEW = 12


class AllowedIds(LogitsProcessor):
    def __init__(self, allowed: list[int]) -> None:
        self.allowed = torch.tensor(allowed)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(scores, -torch.inf)
        out[:, self.allowed] = scores[:, self.allowed]
        return out


@pytest.fixture(scope="module")
def setup(make_checkpoint, hf_model_cache):
    model_dir = make_checkpoint(**CHECKPOINTS["llama-gqa"])
    llm = LLM(model_dir, num_kv_blocks=64, block_size=4)
    yield llm, hf_model_cache(model_dir)
    llm.close()


def _prompts() -> list[list[int]]:
    return random_prompts(3, 500, 4, 12, seed=29)


def _check(llm, hf, prompt, params: SamplingParams, processors: list[LogitsProcessor]) -> list[int]:
    out = llm.generate([prompt], params)[0]
    ref_tokens, ref_lps = hf_greedy(hf, prompt, MAX_NEW, logits_processor=LogitsProcessorList(processors))
    # The engine stops at EOS / a stop token; transformers (EOS off in hf_greedy) goes on past it.
    n = len(out.token_ids)
    assert_greedy_match(out.token_ids, None, ref_tokens[:n], ref_lps[:n], label=str(params))
    return out.token_ids


def test_allowed_token_ids_match_transformers(setup) -> None:
    llm, hf = setup
    allowed = list(range(40, 60)) + [7, 300]
    for prompt in _prompts():
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, allowed_token_ids=allowed, ignore_eos=True)
        tokens = _check(llm, hf, prompt, params, [AllowedIds(allowed)])
        assert set(tokens) <= set(allowed)


def test_bad_words_match_transformers(setup) -> None:
    llm, hf = setup
    for prompt in _prompts():
        plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))[0]
        first, second, later = plain.token_ids[0], plain.token_ids[1], plain.token_ids[4]
        if prompt[-1] == first:  # transformers also matches the prompt's tail; vLLM (and we) do not
            continue
        words = [[first, second], [later]]  # two-token word: its second token banned after the first
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, bad_words_token_ids=words, ignore_eos=True)
        tokens = _check(llm, hf, prompt, params, [NoBadWordsLogitsProcessor(words)])
        assert tokens[:2] == [first, tokens[1]] and tokens[1] != second, "the two-token word was banned"
        assert later not in tokens
        assert tokens != plain.token_ids


def test_min_tokens_and_logit_bias_match_transformers(setup) -> None:
    llm, hf = setup
    eos = sorted(llm.engine.eos_token_ids)
    for prompt in _prompts():
        # A bias of 100 makes EOS the argmax at every step: only min_tokens holds it back.
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=4, logit_bias={eos[0]: 100.0})
        processors = [
            SequenceBiasLogitsProcessor([[[eos[0]], 100.0]]),
            MinNewTokensLengthLogitsProcessor(len(prompt), 4, eos),
        ]
        out = llm.generate([prompt], params)[0]
        _check(llm, hf, prompt, params, processors)
        assert len(out.token_ids) == 5 and out.token_ids[-1] == eos[0] and out.finish_reason == "stop"


def test_min_tokens_holds_back_stop_token_ids(setup) -> None:
    llm, hf = setup
    eos = sorted(llm.engine.eos_token_ids)
    for prompt in _prompts():
        plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))[0]
        stop_id = plain.token_ids[1]
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[stop_id], min_tokens=3)
        masked = MinNewTokensLengthLogitsProcessor(len(prompt), 3, [stop_id, *eos])
        tokens = _check(llm, hf, prompt, params, [masked])
        assert len(tokens) >= 3 and stop_id not in tokens[:3]


def test_logit_bias_before_repetition_penalty_matches_transformers(setup) -> None:
    llm, hf = setup
    for prompt in _prompts():
        prompt = [*prompt, 45, 300]  # biased tokens seen in the prompt: the penalty acts on biased logits
        greedy = {"temperature": 0, "max_tokens": MAX_NEW, "repetition_penalty": 1.7, "ignore_eos": True}
        plain = llm.generate([prompt], SamplingParams(**greedy))[0].token_ids
        bias = {plain[1]: -6.0, 45: 4.0, 300: 4.0, 12: 2.5}
        processors = [
            SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()]),
            RepetitionPenaltyLogitsProcessor(1.7),
        ]
        tokens = _check(llm, hf, prompt, SamplingParams(**greedy, logit_bias=bias), processors)
        assert tokens != plain


def test_rule_token_ids_outside_the_vocabulary_are_refused(setup) -> None:
    llm, _ = setup
    vocab = llm.engine.model_config.vocab_size
    for params in (
        SamplingParams(allowed_token_ids=[1, vocab]),
        SamplingParams(logit_bias={vocab + 5: 1.0}),
        SamplingParams(bad_words_token_ids=[[3, vocab]]),
    ):
        with pytest.raises(ValueError, match=f"out of the vocabulary: expected 0 <= id < {vocab}"):
            llm.generate([[5, 6, 7]], params)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
        ({"logit_bias": {3: float("nan")}}, "logit_bias"),
        ({"logit_bias": {-2: 1.0}}, "logit_bias"),
    ],
)
def test_invalid_rules_are_refused_by_name(kwargs, field) -> None:
    with pytest.raises(ValueError, match=f"^{field} must"):
        SamplingParams(**kwargs)


def test_stop_strings_wait_for_min_tokens(setup) -> None:
    tok = setup[0].tokenizer
    text = "STOP here ### end of text ### again"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # The token whose text completes the first "###": with min_tokens covering it, the second one stops.
    first = next(k for k in range(len(ids)) if "###" in tok.decode(ids[: k + 1]))
    results = {}
    for min_tokens in (0, first + 1):
        detok = Detokenizer(tok, SamplingParams(stop="###", max_tokens=64, min_tokens=min_tokens))
        for token_id in ids:
            if detok.update([token_id]) is not None:
                break
        results[min_tokens] = detok.text
    assert results[0] == "STOP here "
    assert results[first + 1] == "STOP here ### end of text "
