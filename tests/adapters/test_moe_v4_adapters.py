"""MoE adapters saved on transformers 4 (LoRA on each expert's own gate/up/down nn.Linear, the router an
nn.Linear): served on the fused expert tensors. Oracles: `peft` on transformers 5, which converts such
an adapter when it loads it, where that conversion is complete (no dense MLP layers); and everywhere a
float64 merge of every module's delta into the model's weights, which also covers what PEFT's
conversion drops (the dense layers' MLP, Qwen2-MoE's shared expert) or refuses (a gate without its up,
per-module rank and alpha patterns). Each in one mixed batch with base rows and a transformers-5 adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adapters.format import load_adapter
from adapters.types import AdapterFormatError, AdapterValidationError
from base_engine import LLM, SamplingParams
from base_engine.model.config import load_model_config
from tests.adapters.engine_helpers import make_adapter, peft_model
from tests.adapters.moe_v4_helpers import merged_model, save_v4_adapter
from tests.base_engine.oracle import assert_greedy_match, hf_greedy
from tests.harness.engine_inputs import random_prompts
from tests.harness.families import CHECKPOINTS

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5, ignore_eos=True)
NAMES = [None, "v4", "v5", "v4", None, "v5", "v4"]


def _parts(family: str) -> list[str]:
    return ["w1", "w3", "w2"] if family.startswith("mixtral") else ["gate_proj", "up_proj", "down_proj"]


def _run(model_dir: Path, adapters: dict[str, Path], prompts: list) -> list:
    with LLM(model_dir, num_kv_blocks=128, block_size=4, max_loras=4, max_lora_rank=16) as llm:
        outs = llm.generate(prompts, GREEDY, adapters=[adapters[n] if n else None for n in NAMES])
    for out in outs:
        assert out.finish_reason == "length", out.error
    return outs


def _compare(outs: list, prompts: list, references: dict, label: str) -> int:
    compared = 0
    for i, name in enumerate(NAMES):
        ref_tokens, ref_lps = hf_greedy(references[name], prompts[i], MAX_NEW)
        compared += assert_greedy_match(
            outs[i].token_ids, outs[i].logprobs, ref_tokens, ref_lps, label=f"{label} {name} #{i}"
        )
    return compared


def _v5(model_dir: Path, out: Path) -> Path:
    return make_adapter(model_dir, out, seed=9, r=4, lora_alpha=8, target_modules=["k_proj"],
                        target_parameters=["mlp.experts.down_proj"])  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral-window", "qwen3-moe-fused"])
def test_transformers4_expert_adapter_matches_peft_conversion(family: str, make_checkpoint, tmp_path) -> None:
    model_dir = make_checkpoint(**CHECKPOINTS[family])
    targets = ["q_proj", "v_proj", "gate", *_parts(family)]
    v4 = save_v4_adapter(model_dir, tmp_path / "v4", seed=3, target_modules=targets, r=4, lora_alpha=8)
    adapters = {"v4": v4, "v5": _v5(model_dir, tmp_path / "v5")}
    prompts = random_prompts(len(NAMES), 500, 3, 16, seed=81)
    outs = _run(model_dir, adapters, prompts)
    references = {
        None: peft_model(model_dir, None),
        **{n: peft_model(model_dir, p) for n, p in adapters.items()},
    }
    assert _compare(outs, prompts, references, family) >= len(NAMES) * MAX_NEW - 4


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3-moe", "qwen2-moe"])
def test_transformers4_adapter_with_dense_and_shared_mlp_matches_merged_weights(
    family: str, make_checkpoint, tmp_path
) -> None:
    """Dense layers' MLP (Qwen3-MoE's mlp_only_layers) and the shared expert keep their LoRA; expert 1's
    up_proj has its own rank and expert 2's gate its own alpha (so gate and up scales differ)."""
    model_dir = make_checkpoint(**CHECKPOINTS[family])
    v4 = save_v4_adapter(
        model_dir, tmp_path / "v4", seed=4, target_modules=["o_proj", *_parts(family)], r=4, lora_alpha=8,
        rank_pattern={"experts.1.up_proj": 2}, alpha_pattern={"experts.2.gate_proj": 20},
    )  # fmt: skip
    adapters = {"v4": v4, "v5": _v5(model_dir, tmp_path / "v5")}
    prompts = random_prompts(len(NAMES), 500, 3, 16, seed=82)
    outs = _run(model_dir, adapters, prompts)
    references = {None: peft_model(model_dir, None), "v4": merged_model(model_dir, v4),
                  "v5": peft_model(model_dir, adapters["v5"])}  # fmt: skip
    assert _compare(outs, prompts, references, family) >= len(NAMES) * MAX_NEW - 4


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from base_engine.testing.checkpoint import save_random_checkpoint

    return save_random_checkpoint(tmp_path_factory.mktemp("q3moe"), **CHECKPOINTS["qwen3-moe-fused"])


def test_gate_without_up_and_missing_experts_fuse_to_their_own_deltas(
    qwen3_moe: Path, tmp_path: Path
) -> None:
    """Only experts 0-3's gate_proj (PEFT's conversion refuses a gate without its up): the fused
    gate_up delta is that gate delta in the gate rows, zero in the up rows and for experts 4-7."""
    gates = [f"experts.{e}.gate_proj" for e in range(4)]
    adapter = save_v4_adapter(qwen3_moe, tmp_path / "a", seed=5, target_modules=gates, r=4, lora_alpha=12)
    from safetensors.torch import load_file

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    base = load_model_config(qwen3_moe).base_shapes()
    ours = load_adapter(adapter, base=base)
    size = base.moe.expert_intermediate_size
    for (layer, module), pair in ours.experts.items():
        assert module == "experts.gate_up_proj"
        delta = pair.scale * pair.b.double() @ pair.a.double()
        for e in range(base.moe.num_experts):
            expected = torch.zeros_like(delta[e])
            if e < 4:
                prefix = f"base_model.model.model.layers.{layer}.mlp.experts.{e}.gate_proj"
                gate = (
                    tensors[f"{prefix}.lora_B.weight"].double() @ tensors[f"{prefix}.lora_A.weight"].double()
                )
                expected[:size] = 3.0 * gate
            torch.testing.assert_close(delta[e], expected, rtol=1e-6, atol=1e-6)
    assert sorted(layer for layer, _ in ours.experts) == [
        i for i, s in enumerate(base.moe.sparse_layers) if s
    ]


def _edit(adapter: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    path = adapter / "adapter_model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


_EXPERT = "base_model.model.model.layers.0.mlp.experts.3.up_proj"
_ACT = "base_model.model.model.layers.0.mlp.experts.3.act_fn.lora_A.weight"
BAD_TENSORS = [
    (lambda t: t.pop(f"{_EXPERT}.lora_B.weight"), AdapterFormatError, "3.up_proj.lora_B.weight is missing"),
    (lambda t: t.update({f"{_EXPERT}.lora_A.weight": torch.zeros(3, 64)}), AdapterFormatError, r"\(4, 64\)"),
    (lambda t: t[f"{_EXPERT}.lora_A.weight"].fill_(float("nan")), AdapterValidationError, "non-finite"),
    (lambda t: t.update({_ACT: torch.zeros(4, 64)}), AdapterFormatError, "experts.3.act_fn"),
]


@pytest.mark.parametrize(("edit", "error", "match"), BAD_TENSORS)
def test_bad_per_expert_tensors_refused_by_name(qwen3_moe: Path, tmp_path: Path, edit, error, match) -> None:
    adapter = save_v4_adapter(qwen3_moe, tmp_path / "a", seed=6, target_modules=["gate_proj", "up_proj"], r=4,
                              lora_alpha=8)  # fmt: skip
    _edit(adapter, edit)
    with pytest.raises(error, match=match):
        load_adapter(adapter, base=load_model_config(qwen3_moe).base_shapes())


def test_per_expert_dora_and_fused_rank_above_the_limit_refused(qwen3_moe: Path, tmp_path: Path) -> None:
    base = load_model_config(qwen3_moe).base_shapes()
    adapter = save_v4_adapter(qwen3_moe, tmp_path / "a", seed=7, target_modules=["gate_proj", "up_proj"], r=4,
                              lora_alpha=8)  # fmt: skip
    with pytest.raises(AdapterValidationError, match="the fused rank is 8 .* above max_lora_rank=4"):
        load_adapter(adapter, base=base, max_lora_rank=4)
    assert load_adapter(adapter, base=base, max_lora_rank=8).rank_by_module == {"experts.gate_up_proj": 8}
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterFormatError, match="use_dora on the per-expert modules"):
        load_adapter(adapter, base=base)
