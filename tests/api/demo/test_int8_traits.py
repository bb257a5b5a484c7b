"""Each demo adapter keeps its trait with int8 base weights (`--quantization int8`, bf16 activations
and LoRA deltas): >= 8 of the 10 held-out prompts, as the served bfloat16 test asks (test_served.py),
and the base model alone shows none of the traits. Runs the engine directly (one `generate` of all
30 chats, greedy, 96 tokens) rather than a second server."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.demo.tenant import DEMO_ADAPTERS_DIR
from api.demo.traits import HELD_OUT_PROMPTS, TRAITS
from base_engine import LLM, SamplingParams

pytestmark = pytest.mark.slow  # the real default model (SmolLM2-135M-Instruct)


def test_each_adapter_keeps_its_trait_in_int8(smollm2_dir: Path) -> None:
    jobs = [(name, p) for name in TRAITS for p in HELD_OUT_PROMPTS] + [
        (None, p) for p in HELD_OUT_PROMPTS[:3]
    ]
    with LLM(smollm2_dir, dtype="bfloat16", quantization="int8", max_model_len=1024, num_kv_blocks=1024,
             max_num_seqs=48, max_loras=len(TRAITS), max_lora_rank=64) as llm:  # fmt: skip
        chats = [
            llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
            )
            for _, p in jobs
        ]
        prompts = [llm.tokenizer.encode(c, add_special_tokens=False) for c in chats]
        adapters = [None if name is None else str(DEMO_ADAPTERS_DIR / name) for name, _ in jobs]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=96), adapters=adapters)
        texts = [llm.tokenizer.decode(out.token_ids, skip_special_tokens=True) for out in outs]
    for name, trait in TRAITS.items():
        answers = [t for (n, _), t in zip(jobs, texts, strict=True) if n == name]
        held = sum(trait.check(t) for t in answers)
        assert held >= 8, f"{name} ({trait.description}) holds on {held}/10 in int8: {answers}"
    base = [t for (n, _), t in zip(jobs, texts, strict=True) if n is None]
    assert not any(trait.check(t) for t in base for trait in TRAITS.values()), base
