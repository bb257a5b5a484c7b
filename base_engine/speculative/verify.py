"""Verification of draft tokens: the longest prefix of drafts equal to what the sampler draws anyway.

A request with k drafts is scored as k + 1 rows of one step (its last token and the drafts, one
prefill-like chunk). Row j is sampled exactly as a decode would sample the token after
``output + drafts[:j]``: the same logit processing (penalties, rules, temperature, filters), and for
a seeded request the same uniform, a function of seed and absolute position
(base_engine/seeded_uniform.py). Draft j is accepted iff it equals row j's token; the tokens emitted
are rows 0..a, where a is the number of accepted drafts, so the output is bit-for-bit the
non-speculative one whenever the chunk's logits equal the decode's (stricter than rejection
sampling, which keeps only the distribution).
"""

from __future__ import annotations

from collections.abc import Sequence


def accepted_tokens(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """``sampled`` has len(drafts) + 1 tokens (row j: the token after drafts[:j]); the emitted ones."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(
            f"expected {len(drafts) + 1} sampled tokens for {len(drafts)} drafts, got {len(sampled)}"
        )
    for j, draft in enumerate(drafts):
        if sampled[j] != draft:
            return list(sampled[: j + 1])
    return list(sampled)
