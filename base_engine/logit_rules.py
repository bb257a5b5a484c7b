"""Per-request rules on a row of logits, applied before penalties and temperature (vLLM's v1 sampler
order: allowed token ids, bad words, min tokens, logit bias).

- ``allowed_token_ids``: every other token is masked to -inf (vLLM's field).
- ``bad_words_token_ids``: token sequences that must not be generated. A one-token word is always
  masked; for a longer one, its last token is masked when the output so far ends with the tokens
  before it (transformers' ``NoBadWordsLogitsProcessor``; as vLLM, only output tokens are matched).
- ``min_tokens``: EOS and the stop token ids are masked until that many tokens were generated
  (transformers' ``MinNewTokensLengthLogitsProcessor``); stop strings wait too (base_engine/detokenizer.py).
- ``logit_bias``: OpenAI's field, added to the logits (``SequenceBiasLogitsProcessor`` on single tokens).

Logprobs stay those of the raw logits, as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from base_engine.sampling_params import SamplingParams


def rule_token_ids(params: SamplingParams) -> list[int]:
    """Every token id the request's rules name (checked against the vocabulary at admission)."""
    ids = list(params.allowed_token_ids or ())
    ids += [t for word in params.bad_words_token_ids or () for t in word]
    ids += list(params.logit_bias or {})
    return ids


def check_rule_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """ValueError naming the first token id a rule names outside ``[0, vocab_size)``."""
    for token_id in rule_token_ids(params):
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"token id {token_id} is out of the vocabulary: expected 0 <= id < {vocab_size}")


def apply_logit_rules(
    logits: Tensor,
    idx: list[int],
    params: Sequence[SamplingParams],
    outputs: Sequence[Sequence[int]],
    eos_token_ids: frozenset[int],
) -> Tensor:
    """A copy of ``logits`` [num_rows, vocab] with the rules of rows ``idx`` applied; ``params[j]`` and
    ``outputs[j]`` (tokens generated so far) belong to row ``idx[j]``. The raw logits stay untouched
    for logprobs."""
    out = logits.clone()
    for i, p, output in zip(idx, params, outputs, strict=True):
        row = out[i]  # [vocab], a view into `out`
        if p.allowed_token_ids:
            allowed = torch.tensor(p.allowed_token_ids, device=row.device)
            kept = row[allowed]
            row.fill_(-torch.inf)
            row[allowed] = kept
        banned = _banned_tokens(p.bad_words_token_ids or (), output)
        if len(output) < p.min_tokens:
            banned += list(p.stop_token_ids)
            if not p.ignore_eos:
                banned += list(eos_token_ids)
        if banned:
            row[torch.tensor(banned, device=row.device)] = -torch.inf
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=row.device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device)
            row.index_add_(0, ids, bias)
    return out


def _banned_tokens(bad_words: Sequence[Sequence[int]], output: Sequence[int]) -> list[int]:
    """Last tokens of the bad words whose other tokens end the output:
    word [5, 7, 9], output [..., 5, 7] -> 9 is banned; word [4] -> 4 always."""
    banned = []
    num_output = len(output)
    for word in bad_words:
        prefix_len = len(word) - 1
        if prefix_len > num_output:
            continue
        if prefix_len == 0 or list(output[num_output - prefix_len :]) == list(word[:-1]):
            banned.append(word[-1])
    return banned
