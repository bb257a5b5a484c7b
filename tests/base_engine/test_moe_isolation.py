"""Isolation on an MoE base (vLLM #42008's failure: base requests corrupted once an adapter is loaded): a
base row, or a row of one adapter, is bitwise unaffected by which adapters are loaded in the cache and
which adapters (attention, expert, both) the other rows of its steps use. Deterministic mode makes a
row's bits independent of its batch, so each row is compared with the same request run alone on a
fresh engine; in the fast mode the tokens must match."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from base_engine import LLM, SamplingParams
from tests.adapters.moe_helpers import moe_adapters
from tests.harness.engine_inputs import random_prompts
from tests.harness.families import CHECKPOINTS

MAX_NEW = 5
CHOICES = (None, "attn", "experts", "both")
PROMPTS = random_prompts(6, 500, 3, 16, seed=91)
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_setup(tmp_path_factory: pytest.TempPathFactory):
    from base_engine.testing.checkpoint import save_random_checkpoint

    root = tmp_path_factory.mktemp("moe_iso")
    model_dir = save_random_checkpoint(root / "model", **CHECKPOINTS["qwen3-moe"])
    adapters = moe_adapters(model_dir, root / "adapters")
    solo: dict[tuple[int, str | None], tuple] = {}
    with LLM(
        model_dir, num_kv_blocks=256, block_size=4, max_loras=3, max_lora_rank=8, deterministic=True
    ) as llm:
        for p in range(len(PROMPTS)):
            for name in CHOICES:  # each alone, after only its own adapter was ever needed by a step
                [out] = llm.generate([PROMPTS[p]], PARAMS, adapters=[adapters[name] if name else None])
                solo[(p, name)] = (out.token_ids, out.logprobs)
    return model_dir, adapters, solo


def _engine(model_dir: Path, deterministic: bool) -> LLM:
    return LLM(
        model_dir, num_kv_blocks=256, block_size=4, max_loras=3, max_lora_rank=8,
        deterministic=deterministic, max_num_batched_tokens=24,
    )  # fmt: skip


batches = st.lists(
    st.tuples(st.integers(0, len(PROMPTS) - 1), st.sampled_from(CHOICES)), min_size=2, max_size=6
)


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=batches, preload=st.lists(st.sampled_from(CHOICES[1:]), max_size=3))
def test_rows_are_bitwise_unaffected_by_other_rows_adapters(moe_setup, batch, preload) -> None:
    model_dir, adapters, solo = moe_setup
    with _engine(model_dir, deterministic=True) as llm:
        for name in preload:  # other adapters resident in the cache before the batch
            llm.generate([PROMPTS[0][:3]], SamplingParams(max_tokens=1), adapters=[adapters[name]])
        outs = llm.generate(
            [PROMPTS[p] for p, _ in batch], PARAMS, adapters=[adapters[n] if n else None for _, n in batch]
        )
    for (p, name), out in zip(batch, outs, strict=True):
        tokens, logprobs = solo[(p, name)]
        assert out.token_ids == tokens, (p, name, batch)
        assert out.logprobs == logprobs, (p, name, batch)  # bitwise: floats compared exactly


@pytest.mark.slow
def test_base_rows_keep_their_tokens_beside_expert_adapters_in_the_fast_mode(moe_setup) -> None:
    model_dir, adapters, solo = moe_setup
    batch = [(0, None), (1, "experts"), (2, None), (3, "both"), (4, "attn"), (5, None)]
    with _engine(model_dir, deterministic=False) as llm:
        outs = llm.generate(
            [PROMPTS[p] for p, _ in batch], PARAMS, adapters=[adapters[n] if n else None for _, n in batch]
        )
    for (p, name), out in zip(batch, outs, strict=True):
        assert out.token_ids == solo[(p, name)][0], (p, name)
