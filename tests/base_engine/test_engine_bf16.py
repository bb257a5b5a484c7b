"""The engine in bfloat16 on the CPU against `transformers` running the same checkpoint in bfloat16
(`--dtype auto` on a CPU with AMX / AVX512-BF16), on tiny Llama (GQA), Mistral (sliding window) and
Qwen2 (qkv bias).

Both sides keep the weights, activations and KV cache in bf16 and compute RMSNorm, softmax and RoPE's
cos/sin in float32 the same way. Our logits are computed in float32 from the same bf16-valued
LM-head weights (`CausalLM.keep_float32_logits`), where transformers rounds them to bf16 (up to 0.03
at logits near 8). What also differs is the order of float32 sums inside the GEMMs (our q/k/v and
gate/up are one fused GEMM each; attention is our SDPA call on the paged cache), and each difference is
then rounded to bf16 (8 bits of mantissa: a relative step of 2^-8 = 0.4%) at every layer's output.
So the tolerance is stated in bf16 terms: top-5 logprobs within `ATOL` = 0.1 nat (about 13 bf16
steps of a logit near 1; the largest difference measured here is 0.034-0.042 per family, a 2.4x
margin), and greedy tokens equal up to the first step where the reference's top two are within
`TIE` = 0.05 nat (a gap bf16 rounding can cross). The float32 twin (test_oracle.py) holds 1e-3.
"""

from __future__ import annotations

import pytest
import torch

from base_engine import LLM, SamplingParams
from tests.base_engine.oracle import hf_greedy, is_near_tie
from tests.harness.engine_inputs import random_prompts

VARIANTS = {
    "llama": {"arch": "llama"},
    "mistral-window": {"arch": "mistral", "seed": 5, "sliding_window": 12},
    "qwen2": {"arch": "qwen2", "seed": 2},
}
MAX_NEW = 12
ATOL = 0.1
TIE = 0.05


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cpu_bf16_greedy_matches_transformers_bf16(variant: str, make_checkpoint) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = make_checkpoint(**VARIANTS[variant])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    prompts = random_prompts(4, 500, 3, 40, seed=len(variant))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
    with LLM(model_dir, dtype="bfloat16", num_kv_blocks=64, block_size=16) as llm:
        outs = llm.generate(prompts, params)
    compared = worst = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        ref_tokens, ref_lps = hf_greedy(hf, prompt, MAX_NEW)
        for step, (got, want) in enumerate(zip(out.token_ids, ref_tokens, strict=True)):
            for token, ref_lp in ref_lps[step].items():
                if token in out.logprobs[step]:
                    worst = max(worst, abs(out.logprobs[step][token] - ref_lp))
            compared += 1
            if got != want:
                assert is_near_tie(ref_lps[step], got, want, tie=TIE), (
                    variant,
                    step,
                    got,
                    want,
                    ref_lps[step],
                )
                break
    assert worst <= ATOL, f"{variant}: largest top-5 logprob difference {worst:.4f} > {ATOL}"
    assert compared >= MAX_NEW
