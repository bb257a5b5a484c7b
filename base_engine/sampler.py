"""Turns one step's logits into one token per request.

Semantics follow vLLM's sampler: logprobs are ``log_softmax`` of the raw logits; then the request's
logit rules (allowed token ids, bad words, min tokens, logit bias: base_engine/logit_rules.py), repetition
penalty (CTRL, Keskar et al. 2019: over prompt + output, ``logit > 0 -> logit / r`` else
``logit * r``), frequency / presence penalties (OpenAI API: over output only,
``logit -= f * count + p * (count > 0)``), temperature, top-k, top-p (nucleus, Holtzman et al.
2019), min-p (Nguyen et al. 2024), and finally a draw. Rows with a grammar (``params.constraint``,
base_engine/constraints.py) have the tokens it forbids masked to -inf after the penalties; their
matcher advances by the drawn token.

The draw is inverse-transform sampling: one uniform number per row, looked up in the row's
cumulative distribution. A seeded request's number is a pure function of its seed and the absolute
position of the token drawn (base_engine/seeded_uniform.py), so its tokens depend neither on which
other requests share the batch, nor on its row, nor on how many positions a step scores at once
(speculative verification); that one number per row is also far cheaper on CPU than one exponential
per vocabulary entry.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from base_engine.constraints import advance_constraints, apply_constraints
from base_engine.logit_rules import apply_logit_rules
from base_engine.sampling_params import SamplingParams
from base_engine.seeded_uniform import position_uniform


@dataclass(slots=True)
class SamplingRow:
    """One row of the step's logits and what the sampler needs to know about its request."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far (before this step)
    seed: int | None  # the request's seed (params.seed, or one drawn for it); None: the sampler's stream


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[dict[int, float] | None]  # chosen token + top-N alternatives, None when not asked


class Sampler:
    def __init__(self, seed: int | None = None, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.eos_token_ids = eos_token_ids  # masked with the stop token ids until min_tokens
        # Rows without a seed draw from this one (on CPU; the draws are moved).
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def __call__(self, logits: Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """``logits`` [num_rows, vocab] float; row i belongs to ``rows[i]``."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")
        params = [r.params for r in rows]
        random_idx = [i for i, p in enumerate(params) if not p.is_greedy]
        penalty_idx = [i for i, p in enumerate(params) if p.needs_penalties]
        logprob_idx = [i for i, p in enumerate(params) if p.logprobs is not None]
        constrained_idx = [i for i, p in enumerate(params) if p.constraint is not None]
        rule_idx = [i for i, p in enumerate(params) if p.has_logit_rules]
        if not (random_idx or penalty_idx or logprob_idx or constrained_idx or rule_idx):
            # All-greedy fast path: one argmax, no per-row work.
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(rows))

        raw = logits.float()  # [num_rows, vocab]
        ruled = raw
        if rule_idx:
            rule_params = [params[i] for i in rule_idx]
            outputs = [rows[i].output_token_ids for i in rule_idx]
            ruled = apply_logit_rules(raw, rule_idx, rule_params, outputs, self.eos_token_ids)
        penalized = apply_penalties(ruled, rows) if penalty_idx else ruled
        constraints = [c for p in params if (c := p.constraint) is not None]  # rows constrained_idx
        if constrained_idx:  # grammar masks, on their rows only (logprobs stay those of the raw logits)
            outputs = [rows[i].output_token_ids for i in constrained_idx]
            is_copy = penalized is raw
            penalized = apply_constraints(penalized, constrained_idx, constraints, outputs, copy=is_copy)
        if len(random_idx) == len(rows):
            token_ids = self._sample(penalized, rows)
        else:
            token_ids = penalized.argmax(dim=-1)  # [num_rows]; final for greedy rows
            if random_idx:
                index = torch.tensor(random_idx, device=logits.device)
                token_ids[index] = self._sample(penalized[index], [rows[i] for i in random_idx])
        chosen = token_ids.tolist()
        if constrained_idx:
            advance_constraints(constraints, [chosen[i] for i in constrained_idx])
        logprobs: list[dict[int, float] | None] = [None] * len(rows)
        if logprob_idx:
            for i, lp in zip(logprob_idx, _logprobs(raw, token_ids, params, logprob_idx), strict=True):
                logprobs[i] = lp
        return SamplerOutput(chosen, logprobs)

    def _sample(self, logits: Tensor, rows: list[SamplingRow]) -> Tensor:
        """Temperature, filters and one draw for non-greedy rows: [n, vocab] -> [n] token ids."""
        params = [r.params for r in rows]
        dev = logits.device
        temperature = torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)  # [n, 1]
        logits = logits / temperature
        vocab = logits.shape[1]
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        top_p = [p.top_p for p in params]
        if any(p < 1.0 for p in top_p):
            logits = _apply_top_k_top_p(logits, top_k, top_p)
        elif any(top_k):
            logits = _apply_top_k(logits, top_k)
        if any(p.min_p > 0 for p in params):
            logits = _apply_min_p(logits, [p.min_p for p in params])
        probs = torch.softmax(logits, dim=-1)  # [n, vocab]; filtered tokens are exactly 0
        return inverse_cdf_sample(probs, self._uniforms(rows))

    def _uniforms(self, rows: list[SamplingRow]) -> Tensor:
        """One U[0, 1) per row: f(seed, position of the token drawn) when seeded, else the sampler's."""
        num_unseeded = sum(r.seed is None for r in rows)
        shared = iter(
            torch.rand(
                num_unseeded, dtype=torch.float64, generator=self._generator, device=self._generator.device
            ).tolist()
        )
        u = [
            next(shared)
            if r.seed is None
            else position_uniform(r.seed, len(r.prompt_token_ids) + len(r.output_token_ids))
            for r in rows
        ]
        return torch.tensor(u, dtype=torch.float64, device="cpu")


def apply_penalties(logits: Tensor, rows: list[SamplingRow]) -> Tensor:
    """Repetition, then frequency and presence penalties: [num_rows, vocab] -> a new tensor."""
    idx = [i for i, r in enumerate(rows) if r.params.needs_penalties]
    if not idx:
        return logits
    params = [rows[i].params for i in idx]
    vocab, dev = logits.shape[1], logits.device
    sub = logits[torch.tensor(idx, device=dev)]  # [n, vocab] (a copy)
    output_counts = _token_counts([rows[i].output_token_ids for i in idx], vocab, dev)  # [n, vocab]
    rep = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in rep):
        # Rows without a repetition penalty skip their (possibly long) prompt.
        prompts = [rows[i].prompt_token_ids if r != 1.0 else () for i, r in zip(idx, rep, strict=True)]
        seen = (_token_counts(prompts, vocab, dev) > 0) | (output_counts > 0)
        r = torch.tensor(rep, device=dev).unsqueeze(1)  # [n, 1]
        sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in params], device=dev).unsqueeze(1)
    sub = sub - freq * output_counts - pres * (output_counts > 0).float()
    out = logits.clone()
    out[torch.tensor(idx, device=dev)] = sub
    return out


def _token_counts(seqs: list[Sequence[int]], vocab: int, device: torch.device) -> Tensor:
    """How often each token id occurs in each sequence: [len(seqs), vocab] float32, one scatter."""
    lens = [len(s) for s in seqs]
    counts = torch.zeros(len(seqs), vocab, device=device)
    total = sum(lens)
    if total == 0:
        return counts
    # np.fromiter is ~8x faster than torch.tensor on a long list of Python ints.
    flat = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=total))
    lo, hi = int(flat.min()), int(flat.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"token id out of range: got {lo if lo < 0 else hi}, expected 0 <= id < {vocab}")
    # lens [3, 1] -> row [0, 0, 0, 1]; flat index = row * vocab + token id
    row = torch.repeat_interleave(torch.arange(len(seqs), device="cpu"), torch.tensor(lens, device="cpu"))
    flat_index = (row * vocab + flat).to(device)
    counts.view(-1).scatter_add_(0, flat_index, torch.ones(total, device=device))
    return counts


def _apply_top_k(logits: Tensor, top_k: list[int]) -> Tensor:
    """Keeps each row's k largest logits (k = 0: all); ties with the k-th are kept too."""
    k = torch.tensor(top_k, device=logits.device).unsqueeze(1)  # [n, 1]
    top = logits.topk(max(top_k), dim=-1).values  # [n, max_k], descending
    kth = top.gather(1, (k - 1).clamp_min(0))  # [n, 1]
    kth = torch.where(k > 0, kth, torch.full_like(kth, -torch.inf))
    return logits.masked_fill(logits < kth, -torch.inf)


def _apply_top_k_top_p(logits: Tensor, top_k: list[int], top_p: list[float]) -> Tensor:
    """Top-k, then the smallest set of tokens whose probability reaches p (at least one kept)."""
    dev = logits.device
    vocab = logits.shape[1]
    ascending = logits.sort(dim=-1).values  # [n, vocab]
    k = torch.tensor(top_k, device=dev).unsqueeze(1)
    k = torch.where(k > 0, k, vocab)
    position = torch.arange(vocab, device=dev).unsqueeze(0)  # [1, vocab]
    ascending = ascending.masked_fill(position < vocab - k, -torch.inf)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)  # [n, vocab], ends at ~1
    p = torch.tensor(top_p, device=dev).unsqueeze(1)
    # The low tail whose mass is <= 1 - p goes; it is a prefix of the ascending order.
    removed = cumulative <= 1 - p
    removed[:, -1] = False
    threshold = ascending.gather(1, removed.sum(dim=-1, keepdim=True))  # [n, 1]: smallest kept logit
    return logits.masked_fill(logits < threshold, -torch.inf)


def _apply_min_p(logits: Tensor, min_p: list[float]) -> Tensor:
    """Drops tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p)."""
    floor = torch.tensor(min_p, device=logits.device).log().unsqueeze(1)  # [n, 1]; log 0 = -inf keeps all
    return logits.masked_fill(logits < logits.amax(dim=-1, keepdim=True) + floor, -torch.inf)


def inverse_cdf_sample(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Row i takes the first token whose cumulative probability exceeds ``uniforms[i] * total``."""
    cdf = probs.cumsum(dim=-1)  # [n, vocab]
    total = cdf[:, -1:]  # [n, 1]
    target = uniforms.to(device=probs.device, dtype=torch.float64).unsqueeze(1) * total.double()
    # Rounding must never push the target up to the total: nothing would exceed it.
    target = torch.minimum(target.float(), torch.nextafter(total, torch.zeros_like(total)))
    token_ids = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max(probs.shape[1] - 1)
    # A zero-probability (filtered) token cannot be picked with a sequential cumsum (CPU); a parallel
    # scan (GPU) may round differently, so such rare rows take the most likely token instead.
    is_zero = probs.gather(1, token_ids.unsqueeze(1)).squeeze(1) <= 0
    if bool(is_zero.any()):
        token_ids = torch.where(is_zero, probs.argmax(dim=-1), token_ids)
    return token_ids


def _logprobs(
    raw: Tensor, token_ids: Tensor, params: list[SamplingParams], idx: list[int]
) -> list[dict[int, float]]:
    """Chosen token's logprob then the top-N alternatives', from the raw (unpenalized) logits."""
    index = torch.tensor(idx, device=raw.device)
    logprobs = torch.log_softmax(raw[index], dim=-1)  # [n, vocab]
    chosen_ids = token_ids[index]
    chosen = logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
    num_top = [params[i].logprobs or 0 for i in idx]
    top_values: list[list[float]] = [[] for _ in idx]
    top_ids: list[list[int]] = [[] for _ in idx]
    if max(num_top) > 0:
        top = logprobs.topk(min(max(num_top), raw.shape[1]), dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    # The chosen token comes first; when it is also among the top N, its (equal) value is kept once.
    return [
        {token: chosen[j], **dict(zip(top_ids[j][: num_top[j]], top_values[j][: num_top[j]], strict=True))}
        for j, token in enumerate(chosen_ids.tolist())
    ]
