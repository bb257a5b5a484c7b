"""LoRA on every projection PEFT can target, for every served family (tests/harness/families.py): a mixed
batch of base rows and two adapters gives, row by row, the tokens and logprobs of `peft` (in float64)."""

from __future__ import annotations

import pytest

from base_engine import LLM, SamplingParams
from base_engine.model.config import load_model_config
from tests.adapters.engine_helpers import make_adapter, peft_model
from tests.base_engine.oracle import assert_greedy_match, hf_greedy
from tests.harness.engine_inputs import random_prompts
from tests.harness.families import CHECKPOINTS, FAMILIES

MAX_NEW = 8


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_module_in_a_mixed_batch_matches_peft(family: str, make_checkpoint, tmp_path) -> None:
    model_dir = make_checkpoint(**CHECKPOINTS[family])
    # q/k/v/o and gate/up/down as the checkpoint names them (Phi-3: the fused qkv_proj, gate_up_proj)
    every = list(load_model_config(model_dir).base_shapes().projections)
    adapters = {
        "all8": make_adapter(model_dir, tmp_path / "all8", seed=11, r=8, lora_alpha=16, target_modules=every),
        "all4_rs": make_adapter(
            model_dir,
            tmp_path / "all4",
            seed=12,
            r=4,
            lora_alpha=4,
            use_rslora=True,
            target_modules=every,
        ),
    }
    names = [None, "all8", "all4_rs", "all8", None, "all4_rs"]
    prompts = random_prompts(len(names), 500, 3, 25, seed=41)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
    with LLM(model_dir, num_kv_blocks=128, block_size=4, max_loras=2, max_lora_rank=8) as llm:
        outs = llm.generate(prompts, params, adapters=[adapters[n] if n else None for n in names])
    compared = 0
    for name in (None, "all8", "all4_rs"):
        # float64 reference: with deltas this large a rare ill-conditioned step moves fp32 logprobs by
        # ~1e-3 (transformers fp32 against its own float64 as much as we do), past the near-tie rule's atol.
        ref_model = peft_model(model_dir, adapters[name] if name else None).double()
        for prompt, n, out in zip(prompts, names, outs, strict=True):
            if n == name:
                ref_tokens, ref_lps = hf_greedy(ref_model, prompt, MAX_NEW)
                label = f"{family} {name}"
                compared += assert_greedy_match(out.token_ids, out.logprobs, ref_tokens, ref_lps, label=label)
    assert compared >= 4 * MAX_NEW, "too many near-ties: the check compared almost nothing"


def test_adapter_of_a_multimodal_gemma3_is_refused_by_name(make_checkpoint, tmp_path) -> None:
    """Gemma3ForConditionalGeneration nests its text model (and PEFT's targets reach the vision tower):
    its adapters fail their requests naming the model type; base rows next to them are served."""
    model_dir = make_checkpoint(**CHECKPOINTS["gemma3-vision"])
    adapter = make_adapter(
        model_dir,
        tmp_path / "vision",
        seed=13,
        r=4,
        target_modules=list(load_model_config(model_dir).base_shapes().projections),
    )
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    with LLM(model_dir, num_kv_blocks=32, block_size=4, max_loras=1, max_lora_rank=8) as llm:
        refused, base = llm.generate([[5, 6, 7], [5, 6, 7]], params, adapters=[adapter, None])
    assert refused.finish_reason == "error" and "gemma3" in refused.error
    assert base.finish_reason == "length" and len(base.token_ids) == 2
