"""Embedding LoRA (PEFT's `lora_embedding_A` [r, vocab] / `lora_embedding_B` [hidden, r] on
`embed_tokens`) in the engine against PEFT: greedy tokens and logprobs identical to `PeftModel` in fp32,
in one batch with base rows and plain-LoRA rows; on Gemma 2 / 3, whose embedding scale PEFT applies to
the delta too; refusals of a vocabulary mismatch and of DoRA on the embedding; the coverage report."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from adapters.format import load_adapter
from adapters.types import AdapterFormatError
from adapters.validation import validate_adapter
from base_engine import LLM, SamplingParams
from base_engine.model.config import load_model_config
from tests.adapters.engine_helpers import make_adapter, peft_model, peft_references
from tests.base_engine.oracle import assert_greedy_match, hf_greedy
from tests.harness.engine_inputs import random_prompts
from tests.harness.families import CHECKPOINTS
from tests.harness.peft_adapters import edit_config, edit_tensors

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
NAMES = [None, "emb_q", "lora_qv", "emb_only", None, "emb_q", "lora_qv"]


def make_embedding_adapter(model_dir: Path, out: Path, *, seed: int, **lora_kwargs) -> Path:
    """A PEFT adapter targeting embed_tokens (and whatever else) with random, non-negligible factors:
    PEFT initialises lora_embedding_A to zeros, which would change nothing."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.1)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embedding")
    return {
        "emb_q": make_embedding_adapter(
            tiny_llama_dir,
            root / "emb_q",
            seed=70,
            r=8,
            lora_alpha=16,
            target_modules=["embed_tokens", "q_proj"],
        ),
        "emb_only": make_embedding_adapter(
            tiny_llama_dir,
            root / "emb_only",
            seed=71,
            r=4,
            lora_alpha=4,
            use_rslora=True,
            target_modules=["embed_tokens"],
        ),  # fmt: skip
        "lora_qv": make_adapter(
            tiny_llama_dir, root / "lora_qv", seed=72, r=8, target_modules=["q_proj", "v_proj"]
        ),
    }


def test_saved_tensor_names_are_embedding_factors(adapters) -> None:
    from safetensors import safe_open

    with safe_open(str(adapters["emb_q"] / "adapter_model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "base_model.model.model.embed_tokens.lora_embedding_A" in names
    assert "base_model.model.model.embed_tokens.lora_embedding_B" in names


@pytest.mark.parametrize("deterministic", [False, True])
def test_mixed_embedding_lora_base_batch_matches_peft(tiny_llama_dir, adapters, deterministic: bool) -> None:
    prompts = random_prompts(len(NAMES), 500, 3, 20, seed=73)
    refs = peft_references(tiny_llama_dir, adapters, NAMES, prompts, MAX_NEW)
    # The oracle tells the delta apart: without it the embedding-only adapter would decode as the base.
    assert refs[3][0] != hf_greedy(peft_model(tiny_llama_dir, None), prompts[3], MAX_NEW)[0]
    llm = LLM(
        tiny_llama_dir, num_kv_blocks=128, block_size=4, max_loras=3, max_lora_rank=8,
        max_num_batched_tokens=48, deterministic=deterministic,
    )  # fmt: skip
    outs = llm.generate(prompts, GREEDY, adapters=[adapters[n] if n else None for n in NAMES])
    compared = 0
    for i, out in enumerate(outs):
        assert out.finish_reason == "length", (i, out.error)
        compared += assert_greedy_match(out.token_ids, out.logprobs, *refs[i], label=f"{NAMES[i]} #{i}")
    assert compared >= len(NAMES) * MAX_NEW - 2  # near-ties may cut a comparison short


@pytest.mark.parametrize("family", ["gemma2-softcap", "gemma3-window"])
def test_gemma_embedding_lora_matches_peft(family: str, make_checkpoint, tmp_path: Path) -> None:
    """PEFT multiplies the delta by the base layer's embed_scale (sqrt(hidden)); the engine too."""
    model_dir = make_checkpoint(**CHECKPOINTS[family])
    emb = make_embedding_adapter(
        model_dir, tmp_path / "e", seed=74, r=8, lora_alpha=16, target_modules=["embed_tokens", "v_proj"]
    )
    prompts = random_prompts(3, 500, 4, 12, seed=75)
    picks = [emb, None, emb]
    llm = LLM(model_dir, num_kv_blocks=64, block_size=4, max_loras=2, max_lora_rank=8)
    outs = llm.generate(prompts, GREEDY, adapters=picks)
    peft, base = peft_model(model_dir, emb), peft_model(model_dir, None)
    for i, adapter in enumerate(picks):
        ref_tokens, ref_lps = hf_greedy(peft if adapter else base, prompts[i], MAX_NEW)
        assert_greedy_match(outs[i].token_ids, outs[i].logprobs, ref_tokens, ref_lps, label=f"{family} #{i}")


def test_vocabulary_mismatch_is_refused_by_name(tiny_llama_dir, adapters, tmp_path) -> None:
    import shutil

    directory = shutil.copytree(adapters["emb_q"], tmp_path / "bigger")
    key = "base_model.model.model.embed_tokens.lora_embedding_A"

    def add_tokens(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors[key] = torch.cat([tensors[key], torch.zeros(tensors[key].shape[0], 3)], dim=1).contiguous()
        return tensors

    edit_tensors(directory, add_tokens)
    base = load_model_config(tiny_llama_dir).base_shapes()
    with pytest.raises(
        AdapterFormatError, match=rf"vocabulary of {base.vocab_size + 3} tokens.*own tokenizer"
    ):
        load_adapter(directory, base=base)


def test_dora_on_the_embedding_is_refused_by_name(tiny_llama_dir, adapters, tmp_path) -> None:
    import shutil

    directory = shutil.copytree(adapters["emb_only"], tmp_path / "dora")
    edit_config(directory, use_dora=True)
    with pytest.raises(AdapterFormatError, match="DoRA on an embedding is not supported"):
        load_adapter(directory, base=load_model_config(tiny_llama_dir).base_shapes())


def test_coverage_lists_the_embedding(tiny_llama_dir, adapters) -> None:
    base = load_model_config(tiny_llama_dir).base_shapes()
    summary = validate_adapter(adapters["emb_q"], base=base, max_lora_rank=8, max_size_bytes=1 << 26)
    report = summary.coverage.as_json()
    assert report["kinds"] == ["lora", "embedding"]
    row = report["layers"]["embed_tokens"]["embed_tokens"]
    adapter = load_adapter(adapters["emb_q"], base=base)
    e = adapter.embedding
    expected = float(torch.linalg.norm(e.scale * e.b.double() @ e.a.double()))
    assert row["kind"] == "embedding" and row["rank"] == 8
    assert row["delta_fro"] == pytest.approx(expected, rel=1e-9)
