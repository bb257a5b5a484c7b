"""`modules_to_save` on lm_head and embed_tokens (each adapter's own [vocab, hidden] copy) against PEFT:
greedy tokens and top-5 logprobs identical to `PeftModel` in fp32, in one batch with base rows,
plain-LoRA rows and rows of adapters with their own head / embedding (both schedules); on a tied model,
Gemma 2 (soft-cap after the head, sqrt(hidden) after the embedding) and a chunked vocabulary; the
refusals by name (shape, added tokens, the budget with its figures, norms, a module both targeted and
saved); bytes counted in the cache; the coverage report."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from adapters.cache import adapter_bytes
from adapters.format import load_adapter
from adapters.types import AdapterFormatError, AdapterValidationError
from adapters.validation import validate_adapter
from base_engine import LLM, SamplingParams
from base_engine.model.config import load_model_config
from tests.adapters.engine_helpers import make_adapter, make_saved_adapter, peft_model
from tests.base_engine.oracle import assert_greedy_match, hf_greedy
from tests.harness.engine_inputs import random_prompts
from tests.harness.families import CHECKPOINTS
from tests.harness.peft_adapters import edit_config, edit_tensors

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
NAMES = [None, "own_head", "lora_qv", "own_embed", "own_both", None, "own_head", "lora_qv"]
HEAD = "base_model.model.lm_head.weight"
EMBED = "base_model.model.model.embed_tokens.weight"
CHUNKED = {"arch": "llama", "vocab_size": 2500, "seed": 5}  # 3 LOGITS_CHUNKs on CPU


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("modules_to_save")
    q = {"r": 8, "target_modules": ["q_proj"]}
    return {
        "own_head": make_saved_adapter(tiny_llama_dir, root / "h", seed=90, modules_to_save=["lm_head"], **q),
        "own_embed": make_saved_adapter(
            tiny_llama_dir, root / "e", seed=91, modules_to_save=["embed_tokens"], **q
        ),
        "own_both": make_saved_adapter(
            tiny_llama_dir, root / "b", seed=92, modules_to_save=["lm_head", "embed_tokens"], **q
        ),
        "lora_qv": make_adapter(
            tiny_llama_dir, root / "qv", seed=93, r=8, target_modules=["q_proj", "v_proj"]
        ),
    }


def test_peft_saves_the_copies_under_the_module_names(adapters) -> None:
    from safetensors import safe_open

    with safe_open(str(adapters["own_both"] / "adapter_model.safetensors"), "pt") as f:
        assert {HEAD, EMBED} <= set(f.keys())


@pytest.mark.parametrize("deterministic", [False, True])
def test_mixed_modules_to_save_batch_matches_peft(tiny_llama_dir, adapters, deterministic: bool) -> None:
    prompts = random_prompts(len(NAMES), 500, 3, 20, seed=94)
    refs: dict[int, tuple] = {}
    for name in set(NAMES):
        model = peft_model(tiny_llama_dir, adapters[name] if name else None)
        refs |= {i: hf_greedy(model, prompts[i], MAX_NEW) for i, n in enumerate(NAMES) if n == name}
    llm = LLM(
        tiny_llama_dir, num_kv_blocks=128, block_size=4, max_loras=4, max_lora_rank=8,
        max_num_batched_tokens=48, deterministic=deterministic,
    )  # fmt: skip
    outs = llm.generate(prompts, GREEDY, adapters=[adapters[n] if n else None for n in NAMES])
    compared = 0
    for i, out in enumerate(outs):
        assert out.finish_reason == "length", (i, out.error)
        compared += assert_greedy_match(out.token_ids, out.logprobs, *refs[i], label=f"{NAMES[i]} #{i}")
    assert compared >= len(NAMES) * MAX_NEW - 2


@pytest.mark.parametrize("family", ["llama-tied", "gemma2-softcap", "chunked-vocab"])
def test_tied_and_chunked_modules_to_save_matches_peft(family: str, make_checkpoint, tmp_path: Path) -> None:
    """On a tied model PEFT copies the listed module alone (the other keeps the base weight)."""
    model_dir = make_checkpoint(**(CHUNKED if family == "chunked-vocab" else CHECKPOINTS[family]))
    head = make_saved_adapter(model_dir, tmp_path / "h", seed=95, r=4, target_modules=["v_proj"],
                              modules_to_save=["lm_head"])  # fmt: skip
    embed = make_saved_adapter(model_dir, tmp_path / "e", seed=96, r=4, target_modules=["v_proj"],
                               modules_to_save=["embed_tokens"])  # fmt: skip
    prompts = random_prompts(4, 500, 4, 12, seed=97)
    picks = [head, None, embed, head]
    llm = LLM(model_dir, num_kv_blocks=64, block_size=4, max_loras=3, max_lora_rank=8)
    outs = llm.generate(prompts, GREEDY, adapters=picks)
    models = {p: peft_model(model_dir, p) for p in {head, embed, None}}
    for i, adapter in enumerate(picks):
        ref_tokens, ref_lps = hf_greedy(models[adapter], prompts[i], MAX_NEW)
        assert_greedy_match(outs[i].token_ids, outs[i].logprobs, ref_tokens, ref_lps, label=f"{family} #{i}")


@pytest.mark.parametrize("family", ["llama-gqa", "gemma2-softcap", "qwen3"])
def test_modules_to_save_norms_match_peft(family: str, make_checkpoint, tmp_path: Path) -> None:
    """PEFT's suffix match: "norm" selects every norm (layer norms, model.norm, q/k norms on Qwen 3);
    each adapter's rows run the norm with its own weight (Gemma's (1 + w) form included)."""
    model_dir = make_checkpoint(**CHECKPOINTS[family])
    norms = make_saved_adapter(model_dir, tmp_path / "n", seed=98, r=4, target_modules=["v_proj"],
                               modules_to_save=["norm"])  # fmt: skip
    layer0 = make_saved_adapter(model_dir, tmp_path / "l0", seed=99, r=4, target_modules=["o_proj"],
                                modules_to_save=["layers.0.input_layernorm", "lm_head"])  # fmt: skip
    prompts = random_prompts(4, 500, 4, 12, seed=100)
    picks = [norms, None, layer0, norms]
    llm = LLM(model_dir, num_kv_blocks=64, block_size=4, max_loras=3, max_lora_rank=8)
    outs = llm.generate(prompts, GREEDY, adapters=picks)
    models = {p: peft_model(model_dir, p) for p in {norms, layer0, None}}
    assert hf_greedy(models[norms], prompts[0], MAX_NEW)[0] != hf_greedy(models[None], prompts[0], MAX_NEW)[0]
    for i, adapter in enumerate(picks):
        ref_tokens, ref_lps = hf_greedy(models[adapter], prompts[i], MAX_NEW)
        assert_greedy_match(outs[i].token_ids, outs[i].logprobs, ref_tokens, ref_lps, label=f"{family} #{i}")


def _copy(adapters, name: str, tmp_path: Path) -> Path:
    return shutil.copytree(adapters[name], tmp_path / name)


def test_wrong_shape_is_refused_naming_vocab_by_hidden(tiny_llama_dir, adapters, tmp_path) -> None:
    base = load_model_config(tiny_llama_dir).base_shapes()
    directory = _copy(adapters, "own_head", tmp_path)
    edit_tensors(directory, lambda t: {**t, HEAD: torch.randn(base.vocab_size, base.hidden_size - 1)})
    expected = rf"shape \({base.vocab_size}, {base.hidden_size - 1}\), expected \({base.vocab_size}, "
    with pytest.raises(AdapterFormatError, match=expected + rf"{base.hidden_size}\) \(\[vocab, hidden\]"):
        load_adapter(directory, base=base)


def test_added_tokens_are_refused_by_name(tiny_llama_dir, adapters, tmp_path) -> None:
    base = load_model_config(tiny_llama_dir).base_shapes()
    directory = _copy(adapters, "own_embed", tmp_path)
    edit_tensors(directory, lambda t: {**t, EMBED: torch.randn(base.vocab_size + 2, base.hidden_size)})
    with pytest.raises(AdapterFormatError, match="needs its own tokenizer; out of scope"):
        load_adapter(directory, base=base)


def test_over_budget_is_refused_with_the_figures(tiny_llama_dir, adapters) -> None:
    base = load_model_config(tiny_llama_dir).base_shapes()
    needed = 2 * base.vocab_size * base.hidden_size * 4
    with pytest.raises(
        AdapterValidationError,
        match=rf"need {needed} bytes .* above the budget of {needed - 1} bytes .*max_replacement_bytes",
    ):
        validate_adapter(adapters["own_both"], base=base, max_lora_rank=8, max_size_bytes=1 << 26,
                         max_replacement_bytes=needed - 1)  # fmt: skip
    validate_adapter(adapters["own_both"], base=base, max_lora_rank=8, max_size_bytes=1 << 26,
                     max_replacement_bytes=needed)  # fmt: skip


@pytest.mark.parametrize(
    ("config", "cause"),
    [
        ({"modules_to_save": ["act_fn"]}, "merge the adapter into the base model"),
        ({"modules_to_save": ["rotary_emb"]}, "merge the adapter into the base model"),
        ({"modules_to_save": ["q_proj"]}, "merge the adapter into the base model"),
        ({"target_modules": ["q_proj", "lm_head"]}, "both in modules_to_save and a LoRA target"),
        ({"modules_to_save": ["lm_head_x"]}, "names no module"),
        ({"ensure_weight_tying": True}, "copies tied between embed_tokens and lm_head are not supported"),
    ],
)
def test_other_modules_are_refused_by_name(tiny_llama_dir, adapters, tmp_path, config, cause) -> None:
    directory = _copy(adapters, "own_head", tmp_path)
    edit_config(directory, **config)
    with pytest.raises(AdapterFormatError, match=cause):
        load_adapter(directory, base=load_model_config(tiny_llama_dir).base_shapes())


def test_copies_are_counted_in_the_cache_bytes_and_the_coverage(tiny_llama_dir, adapters) -> None:
    base = load_model_config(tiny_llama_dir).base_shapes()
    adapter = load_adapter(adapters["own_both"], base=base)
    copies = 2 * base.vocab_size * base.hidden_size * 4
    factors = sum(p.a.numel() * 4 + p.b.numel() * 4 for p in adapter.weights.values())
    assert adapter_bytes(adapter) == copies + factors
    summary = validate_adapter(adapters["own_both"], base=base, max_lora_rank=8, max_size_bytes=1 << 26)
    report = summary.coverage.as_json()
    assert report["kinds"] == ["lora", "modules_to_save"]
    row = report["layers"]["lm_head"]["lm_head"]
    assert row["kind"] == "modules_to_save" and row["relative_delta"] is None
    assert row["delta_fro"] == pytest.approx(
        float(torch.linalg.norm(adapter.replacements["lm_head"].double()))
    )


def test_coverage_lists_norm_copies_per_layer(make_checkpoint, tmp_path) -> None:
    model_dir = make_checkpoint(**CHECKPOINTS["llama-gqa"])
    directory = make_saved_adapter(model_dir, tmp_path / "n", seed=101, r=4, target_modules=["v_proj"],
                                   modules_to_save=["input_layernorm", "model.norm"])  # fmt: skip
    base = load_model_config(model_dir).base_shapes()
    summary = validate_adapter(directory, base=base, max_lora_rank=8, max_size_bytes=1 << 26)
    layers = summary.coverage.as_json()["layers"]
    assert layers["0"]["input_layernorm"]["kind"] == "modules_to_save"
    assert layers["1"]["input_layernorm"]["kind"] == "modules_to_save"
    assert layers["norm"]["norm"]["kind"] == "modules_to_save"
    assert "post_attention_layernorm" not in layers["0"]
