"""The drafter's own KV cache (base_engine/speculative/draft_model.py) changes no proposal: over random
verify outcomes (some drafts accepted, the rest rolled back, a sampled token appended), a request whose
context is rewritten (a prefix only in common) and a released one, the cached drafter proposes exactly
what the drafter recomputing the whole context each step proposes, and runs far fewer tokens."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from base_engine.model.config import load_model_config
from base_engine.model.tokenizer import load_tokenizer
from base_engine.speculative.draft_model import DraftModelProposer
from base_engine.testing.checkpoint import save_random_checkpoint

VOCAB = 512
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "intermediate_size": 64, "vocab_size": VOCAB, "max_position_embeddings": 256,
        "init_scale": 0.8}  # fmt: skip


@pytest.fixture(scope="module")
def drafters(tmp_path_factory: pytest.TempPathFactory) -> tuple[DraftModelProposer, DraftModelProposer]:
    path = save_random_checkpoint(tmp_path_factory.mktemp("draft-cache") / "drafter", **TINY)
    config, tok = load_model_config(path), load_tokenizer(path)
    cached = DraftModelProposer(path, config, tok, device=torch.device("cpu"))
    fresh = DraftModelProposer(path, config, tok, device=torch.device("cpu"))
    fresh.use_cache = False
    return cached, fresh


# One verify: (drafts asked, drafts accepted as a fraction, the sampled token, whether it is the
# drafter's own next one, "rewrite" = keep only a prefix of the context, then new tokens).
STEP = st.tuples(
    st.integers(1, 4), st.floats(0, 1), st.integers(0, VOCAB - 1), st.booleans(), st.integers(0, 9)
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
    steps=st.lists(STEP, min_size=1, max_size=12),
)
def test_cached_drafter_proposes_what_the_recomputing_one_does(drafters, prompt, steps) -> None:
    cached, fresh = drafters
    cached.release("r")
    tokens = list(prompt)
    run_cached, run_fresh = cached.num_tokens_run, fresh.num_tokens_run
    for k, fraction, sampled, follows, rewrite in steps:
        drafts = cached.propose("r", tokens, k)
        assert drafts == fresh.propose("r", tokens, k)
        num_accepted = int(fraction * len(drafts))
        bonus = drafts[num_accepted] if follows and num_accepted < len(drafts) else sampled
        tokens = tokens + drafts[:num_accepted] + [bonus]
        if rewrite == 0:  # e.g. recomputed after preemption with another continuation
            tokens = tokens[: len(tokens) // 2 + 1] + [sampled]
        elif rewrite == 1:
            cached.release("r")  # left the running set: starts afresh
        tokens = tokens[: TINY["max_position_embeddings"] - 8]
    assert cached.num_tokens_run - run_cached <= fresh.num_tokens_run - run_fresh


def test_the_cache_runs_only_new_tokens(drafters) -> None:
    cached, _ = drafters
    cached.release("s")
    tokens = list(range(1, 41))
    before = cached.num_tokens_run
    drafts = cached.propose("s", tokens, 3)
    assert cached.num_tokens_run - before == 40 + 2  # the prefill, then 2 one-token steps
    before = cached.num_tokens_run
    cached.propose("s", tokens + drafts[:1] + [7], 3)  # one accepted, the second rolled back
    assert cached.num_tokens_run - before == 1 + 2  # only the sampled token, then 2 steps
    assert len(cached.caches["s"].tokens) == len(tokens) + 2 + 2
    cached.release("s")
    assert "s" not in cached.caches
