"""lm_head LoRA (PEFT's `lora_A` [r, hidden] / `lora_B` [vocab, r] on `lm_head`) in the engine against
PEFT: greedy tokens and top-5 logprobs identical to `PeftModel` in fp32, in one batch with base rows,
plain-LoRA rows and lm_head-LoRA rows (both schedules: default and deterministic); on tied models (Llama
tied, Gemma 2 with its final soft-cap: PEFT wraps the tied head alone, and the delta goes before the cap);
a constrained (JSON) request with an lm_head adapter; refusals by name; the coverage report."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from adapters.cache import AdapterCache
from adapters.format import load_adapter
from adapters.types import AdapterFormatError
from adapters.validation import validate_adapter
from base_engine import LLM, SamplingParams
from base_engine.constraints import GrammarCompiler
from base_engine.lora import local_fetch
from base_engine.model.config import load_model_config
from base_engine.model.decoder import LOGITS_CHUNK
from base_engine.model_weights import ModelWeights
from tests.adapters.engine_helpers import make_adapter, peft_model, peft_references
from tests.base_engine.oracle import assert_greedy_match, hf_greedy
from tests.harness.engine_inputs import random_prompts
from tests.harness.families import CHECKPOINTS
from tests.harness.peft_adapters import edit_config, edit_tensors

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
NAMES = [None, "head_q", "lora_qv", "head_only", None, "head_q", "lora_qv"]
HEAD_A = "base_model.model.lm_head.lora_A.weight"
HEAD_B = "base_model.model.lm_head.lora_B.weight"
HEAD_COPY = "base_model.model.lm_head.base_layer.weight"


def make_head_adapter(model_dir: Path, out: Path, *, seed: int, **lora_kwargs) -> Path:
    """A PEFT adapter targeting lm_head (and whatever else) with random, non-negligible factors."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn_like(param) * 0.2)
        model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lm_head")
    return {
        "head_q": make_head_adapter(
            tiny_llama_dir, root / "head_q", seed=80, r=8, lora_alpha=16, target_modules=["lm_head", "q_proj"]
        ),
        "head_only": make_head_adapter(
            tiny_llama_dir,
            root / "head_only",
            seed=81,
            r=4,
            lora_alpha=4,
            use_rslora=True,
            target_modules=["lm_head"],
        ),  # fmt: skip
        "lora_qv": make_adapter(
            tiny_llama_dir, root / "lora_qv", seed=82, r=8, target_modules=["q_proj", "v_proj"]
        ),
    }


def test_saved_tensor_names_are_lm_head_factors_and_the_base_head(adapters) -> None:
    from safetensors import safe_open

    with safe_open(str(adapters["head_q"] / "adapter_model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {HEAD_A, HEAD_B, HEAD_COPY} <= names  # PEFT's save_embedding_layers="auto" counts lm_head


@pytest.mark.parametrize("deterministic", [False, True])
def test_mixed_lm_head_lora_base_batch_matches_peft(tiny_llama_dir, adapters, deterministic: bool) -> None:
    prompts = random_prompts(len(NAMES), 500, 3, 20, seed=83)
    refs = peft_references(tiny_llama_dir, adapters, NAMES, prompts, MAX_NEW)
    # The oracle tells the delta apart: without it the head-only adapter would decode as the base.
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


# A vocabulary above LOGITS_CHUNK (1024) and not a multiple of it: the CPU head runs in 3 chunks.
CHUNKED = {"arch": "llama", "vocab_size": 2500, "seed": 5}


@pytest.mark.parametrize("family", ["llama-tied", "gemma2-softcap", "chunked-vocab"])
def test_tied_and_chunked_lm_head_lora_matches_peft(family: str, make_checkpoint, tmp_path: Path) -> None:
    """On a tied model PEFT wraps lm_head alone (the embedding keeps the base weight; `ensure_weight_tying`
    unset): the engine adds the delta to the logits only, before Gemma 2's final soft-cap; and with the
    vocabulary-chunked LM head on CPU."""
    assert LOGITS_CHUNK < CHUNKED["vocab_size"]
    model_dir = make_checkpoint(**(CHUNKED if family == "chunked-vocab" else CHECKPOINTS[family]))
    head = make_head_adapter(
        model_dir, tmp_path / "h", seed=84, r=8, lora_alpha=16, target_modules=["lm_head", "v_proj"]
    )
    prompts = random_prompts(3, 500, 4, 12, seed=85)
    picks = [head, None, head]
    llm = LLM(model_dir, num_kv_blocks=64, block_size=4, max_loras=2, max_lora_rank=8)
    outs = llm.generate(prompts, GREEDY, adapters=picks)
    peft, base = peft_model(model_dir, head), peft_model(model_dir, None)
    for i, adapter in enumerate(picks):
        ref_tokens, ref_lps = hf_greedy(peft if adapter else base, prompts[i], MAX_NEW)
        assert_greedy_match(outs[i].token_ids, outs[i].logprobs, ref_tokens, ref_lps, label=f"{family} #{i}")


def test_structured_output_with_an_lm_head_adapter_is_valid_json(tiny_llama_dir, adapters) -> None:
    """The delta lands before the grammar's mask: a constrained row still parses."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    }
    llm = LLM(tiny_llama_dir, num_kv_blocks=128, block_size=4, max_loras=2, max_lora_rank=8)
    engine = llm.engine
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    params = [
        SamplingParams(max_tokens=80, temperature=0.0,
                       constraint=compiler.compile_json_schema(schema).new_constraint()),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    ]  # fmt: skip
    prompts = random_prompts(2, 500, 4, 10, seed=86)
    outs = llm.generate(prompts, params, adapters=[adapters["head_only"], adapters["head_q"]])
    assert outs[0].finish_reason == "stop", outs[0].text
    value = json.loads(outs[0].text)
    assert set(value) == {"name", "ok"} and isinstance(value["ok"], bool)


def test_vocabulary_mismatch_is_refused_by_name(tiny_llama_dir, adapters, tmp_path) -> None:
    directory = shutil.copytree(adapters["head_q"], tmp_path / "bigger")

    def add_tokens(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tensors[HEAD_B] = torch.cat([tensors[HEAD_B], torch.zeros(3, tensors[HEAD_B].shape[1])]).contiguous()
        return tensors

    edit_tensors(directory, add_tokens)
    base = load_model_config(tiny_llama_dir).base_shapes()
    with pytest.raises(
        AdapterFormatError, match=rf"vocabulary of {base.vocab_size + 3} tokens.*own tokenizer"
    ):
        load_adapter(directory, base=base)


def test_dora_on_the_lm_head_is_refused_by_name(tiny_llama_dir, adapters, tmp_path) -> None:
    directory = shutil.copytree(adapters["head_only"], tmp_path / "dora")
    edit_config(directory, use_dora=True)
    with pytest.raises(AdapterFormatError, match="DoRA on the LM head is not supported"):
        load_adapter(directory, base=load_model_config(tiny_llama_dir).base_shapes())


def test_weight_tying_with_an_lm_head_lora_is_refused_by_name(make_checkpoint, tmp_path) -> None:
    """PEFT's ensure_weight_tying ties the head's LoRA to the embedding's: refused, not half-applied."""
    model_dir = make_checkpoint(**CHECKPOINTS["llama-tied"])
    directory = make_head_adapter(
        model_dir, tmp_path / "tied", seed=87, r=4, target_modules=["lm_head", "q_proj"],
        ensure_weight_tying=True,
    )  # fmt: skip
    with pytest.raises(AdapterFormatError, match="ensure_weight_tying=true with tensor 'base_model"):
        load_adapter(directory, base=load_model_config(model_dir).base_shapes())


def test_a_trained_base_head_is_refused_at_load(tiny_llama_dir, adapters, tmp_path) -> None:
    """PEFT loads the saved base head over the model's: one that differs is a trained head, not LoRA."""
    directory = shutil.copytree(adapters["head_only"], tmp_path / "trained")
    edit_tensors(directory, lambda t: {**t, HEAD_COPY: t[HEAD_COPY] + 1.0})
    llm = LLM(tiny_llama_dir, num_kv_blocks=32, block_size=4, max_loras=1, max_lora_rank=8)
    cache = AdapterCache(
        load_model_config(tiny_llama_dir).base_shapes(), fetch=local_fetch, max_loras=1, max_lora_rank=8,
        max_cpu_loras=1, dtype=torch.float32, device=torch.device("cpu"),
        base_weights=ModelWeights(llm.engine.runner.model),
    )  # fmt: skip
    try:
        with pytest.raises(AdapterFormatError, match="differs from the served model's LM head"):
            cache._parse(directory)
        cache._parse(adapters["head_only"])  # the untouched copy is the served head: accepted
    finally:
        cache.close()


def test_coverage_lists_the_lm_head(tiny_llama_dir, adapters) -> None:
    base = load_model_config(tiny_llama_dir).base_shapes()
    llm = LLM(tiny_llama_dir, num_kv_blocks=32, block_size=4)
    norms = ModelWeights(llm.engine.runner.model).frobenius_norms()
    summary = validate_adapter(
        adapters["head_q"], base=base, max_lora_rank=8, max_size_bytes=1 << 26, weight_norms=norms
    )
    report = summary.coverage.as_json()
    assert report["kinds"] == ["lora", "lm_head"]
    row = report["layers"]["lm_head"]["lm_head"]
    head = load_adapter(adapters["head_q"], base=base).lm_head
    expected = float(torch.linalg.norm(head.scale * head.b.double() @ head.a.double()))
    weight = llm.engine.runner.model.lm_head.weight.detach().double()
    assert row["kind"] == "lm_head" and row["rank"] == 8
    assert row["delta_fro"] == pytest.approx(expected, rel=1e-9)
    assert row["relative_delta"] == pytest.approx(expected / float(torch.linalg.norm(weight)), rel=1e-9)
