"""`modules_to_save` copies served in bfloat16: held in the serving dtype (and counted in it, 2 bytes a
value, in the cache's host bytes), and a mixed batch of base rows, plain-LoRA rows and rows with their own
lm_head / embed_tokens / both against `PeftModel` on the same checkpoint in bfloat16.

The oracle is PEFT on the same checkpoint in bf16 with `autocast_adapter_dtype=False`: its LoRA factors
in bf16 as ours are (PEFT's default keeps them in float32 on a bf16 base, a more precise model than the
one served, off by up to 0.07 nat in the first steps on plain-LoRA rows alike), its copies in bf16 as
ours are, and its logits computed in float32 from the bf16-valued head as ours are. The tolerance is the
repo's bf16 one (tests/base_engine/test_engine_bf16.py explains it): top-5 logprobs within 0.1 nat,
greedy tokens equal up to the first step where the reference's top two are within 0.05 nat. The copies
are moved off the base weights by 0.3 of their mean magnitude (as trained copies stay near them): with
a full-magnitude perturbation the rounding of the larger hidden states reaches 0.11 nat."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from adapters.cache import adapter_bytes
from base_engine import LLM, SamplingParams
from tests.adapters.engine_helpers import make_adapter, make_saved_adapter
from tests.base_engine.oracle import hf_greedy, is_near_tie
from tests.harness.engine_inputs import random_prompts

MAX_NEW = 8
ATOL = 0.1  # test_engine_bf16.py's
TIE = 0.05
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
NOISE = 0.3  # copies within the base weights' range, where the bf16 tolerance was measured
NAMES = [None, "own_head", "lora_qv", "own_embed", "own_both", None, "own_head", "lora_qv"]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("modules_to_save_bf16")
    q = {"r": 8, "target_modules": ["q_proj"], "copy_noise": NOISE}
    return {
        "own_head": make_saved_adapter(
            tiny_llama_dir, root / "h", seed=190, modules_to_save=["lm_head"], **q
        ),
        "own_embed": make_saved_adapter(
            tiny_llama_dir, root / "e", seed=191, modules_to_save=["embed_tokens"], **q
        ),
        "own_both": make_saved_adapter(
            tiny_llama_dir, root / "b", seed=192, modules_to_save=["lm_head", "embed_tokens"], **q
        ),
        "lora_qv": make_adapter(
            tiny_llama_dir, root / "qv", seed=193, r=8, target_modules=["q_proj", "v_proj"]
        ),
    }


def _peft_bf16(model_dir: Path, adapter_dir: Path | None):
    """PEFT on the checkpoint in bf16, its logits computed in float32 from the bf16-valued head (the
    copy's, where the adapter has one), as the engine computes them (`keep_float32_logits`): transformers
    would round them to bf16, a step of 0.0625 at logits near 8, wider than the near-tie gap."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir, autocast_adapter_dtype=False)
    head = getattr(model, "get_base_model", lambda: model)().lm_head  # PEFT's ModulesToSaveWrapper too
    head.float()
    head.register_forward_pre_hook(lambda _module, args: tuple(a.float() for a in args))
    return model.eval()


def _compare(tokens, logprobs, ref_tokens, ref_lps, label: str) -> tuple[int, float]:
    """Steps compared (up to the first bf16 near-tie divergence) and the largest logprob difference."""
    worst = 0.0
    for step, (got, want) in enumerate(zip(tokens, ref_tokens, strict=True)):
        for token, ref_lp in ref_lps[step].items():
            if token in logprobs[step]:
                worst = max(worst, abs(logprobs[step][token] - ref_lp))
        if got != want:
            assert is_near_tie(ref_lps[step], got, want, tie=TIE), (label, step, got, want, ref_lps[step])
            return step + 1, worst
    return len(ref_tokens), worst


def test_mixed_bf16_batch_with_copies_matches_peft_bf16(tiny_llama_dir: Path, adapters) -> None:
    prompts = random_prompts(len(NAMES), 500, 3, 20, seed=194)
    refs: dict[int, tuple] = {}
    for name in set(NAMES):
        model = _peft_bf16(tiny_llama_dir, adapters[name] if name else None)
        refs |= {i: hf_greedy(model, prompts[i], MAX_NEW) for i, n in enumerate(NAMES) if n == name}
    with LLM(tiny_llama_dir, dtype="bfloat16", num_kv_blocks=128, block_size=4, max_loras=4,
             max_lora_rank=8, max_num_batched_tokens=48) as llm:  # fmt: skip
        outs = llm.generate(prompts, GREEDY, adapters=[adapters[n] if n else None for n in NAMES])
        cache = llm.engine.lora.cache
        held = {ref_id: cache.host[ref_id] for ref_id in cache.host}
        host_bytes = dict(cache.host_bytes)
    compared = worst = 0
    for i, out in enumerate(outs):
        assert out.finish_reason == "length", (i, out.error)
        steps, diff = _compare(out.token_ids, out.logprobs, *refs[i], label=f"{NAMES[i]} #{i}")
        compared, worst = compared + steps, max(worst, diff)
    assert worst <= ATOL, f"largest top-5 logprob difference {worst:.4f} > {ATOL}"
    assert compared >= len(NAMES) * MAX_NEW - 8  # 60 of 64 steps when measured (largest diff 0.043)
    with_copies = {ref_id: a for ref_id, a in held.items() if a.replacements}
    assert len(with_copies) == 3  # own_head, own_embed, own_both
    for ref_id, adapter in with_copies.items():
        assert all(t.dtype == torch.bfloat16 for t in adapter.replacements.values()), ref_id
        copies = sum(t.numel() * 2 for t in adapter.replacements.values())
        assert host_bytes[ref_id] == adapter_bytes(adapter) and host_bytes[ref_id] >= copies


def test_bf16_copies_change_the_tokens(tiny_llama_dir: Path, adapters) -> None:
    """The copies matter in bf16 (else the comparison above would not tell them apart from the base)."""
    prompt = random_prompts(1, 500, 8, 9, seed=195)[0]
    base = hf_greedy(_peft_bf16(tiny_llama_dir, None), prompt, MAX_NEW)[0]
    assert hf_greedy(_peft_bf16(tiny_llama_dir, adapters["own_both"]), prompt, MAX_NEW)[0] != base
