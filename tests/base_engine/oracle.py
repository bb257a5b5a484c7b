"""Comparing generations under the near-tie rule: tokens must be equal until the first step where the
reference's top two candidates are within `tie` of each other; logprobs must agree to `atol` up to there."""

from __future__ import annotations

import torch

NEAR_TIE = 1e-3


def hf_greedy(
    model, prompt_ids: list[int], max_new_tokens: int, top: int = 5, **kwargs
) -> tuple[list[int], list[dict[int, float]]]:
    """Reference greedy decode with transformers; returns tokens and top-`top` raw logprobs per step."""
    input_ids = torch.tensor([prompt_ids])
    # ignore_eos semantics: keep going past EOS without masking it (min_new_tokens would mask it).
    config = getattr(model, "get_base_model", lambda: model)().generation_config  # PeftModel wraps
    saved_eos = config.eos_token_id
    config.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
                **kwargs,
            )
    finally:
        config.eos_token_id = saved_eos
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    rows = []
    for logits in out.logits:
        logprobs = torch.log_softmax(logits[0].double(), dim=-1)
        values, ids = logprobs.topk(top)
        rows.append(dict(zip(ids.tolist(), values.tolist(), strict=True)))
    return tokens, rows


def is_near_tie(row: dict[int, float], a: int, b: int, tie: float = NEAR_TIE) -> bool:
    if a not in row or b not in row:
        top = sorted(row.values(), reverse=True)
        return len(top) >= 2 and top[0] - top[1] < tie
    return abs(row[a] - row[b]) < tie


def assert_greedy_match(
    got_tokens: list[int],
    got_logprobs: list[dict[int, float]] | None,
    ref_tokens: list[int],
    ref_logprobs: list[dict[int, float]],
    *,
    atol: float = 1e-3,
    label: str = "",
) -> int:
    """Returns the number of steps compared (up to the first near-tie divergence)."""
    n = min(len(got_tokens), len(ref_tokens))
    for i in range(n):
        if got_logprobs is not None:
            for tok, ref_lp in ref_logprobs[i].items():
                if tok in got_logprobs[i]:
                    assert abs(got_logprobs[i][tok] - ref_lp) <= atol, (
                        f"{label} step {i} token {tok}: logprob {got_logprobs[i][tok]} vs reference {ref_lp}"
                    )
        if got_tokens[i] != ref_tokens[i]:
            assert is_near_tie(ref_logprobs[i], got_tokens[i], ref_tokens[i]), (
                f"{label} step {i}: got token {got_tokens[i]}, reference {ref_tokens[i]} without a near-tie "
                f"(reference top: {ref_logprobs[i]})"
            )
            return i
    assert len(got_tokens) == len(ref_tokens), f"{label}: {len(got_tokens)} tokens vs {len(ref_tokens)}"
    return n


def assert_same_generation(
    a_tokens: list[int],
    a_lps: list[dict[int, float]],
    b_tokens: list[int],
    b_lps: list[dict[int, float]],
    *,
    atol: float = 1e-3,
    label: str = "",
) -> None:
    """Two runs of our engine (e.g. alone vs in a batch) under the same near-tie rule."""
    for i in range(min(len(a_tokens), len(b_tokens))):
        for tok, lp in a_lps[i].items():
            if tok in b_lps[i]:
                assert abs(b_lps[i][tok] - lp) <= atol, (
                    f"{label} step {i} token {tok}: {b_lps[i][tok]} vs {lp}"
                )
        if a_tokens[i] != b_tokens[i]:
            assert is_near_tie(a_lps[i], a_tokens[i], b_tokens[i]), (
                f"{label} step {i}: diverged without near-tie"
            )
            return
    assert len(a_tokens) == len(b_tokens), f"{label}: lengths {len(a_tokens)} vs {len(b_tokens)}"
