"""adapters.format against PEFT: loaded A/B/scale reproduce PEFT's delta_W, and what PEFT applies
differently (or cannot express on the seven projections) is refused with the cause named."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from adapters import LORA_MODULES, AdapterFormatError, load_adapter
from adapters.peft_targets import module_keys
from tests.harness.peft_adapters import (
    edit_config,
    edit_tensors,
    peft_deltas,
    save_peft_adapter,
    tiny_model,
    tiny_shapes,
)

ALL = list(LORA_MODULES)


def assert_matches_peft(adapter_dir: Path, model_type: str = "llama", **load_kwargs: Any) -> None:
    """scale * B @ A of every loaded module equals PEFT's get_delta_weight, and the module sets agree."""
    ours = load_adapter(adapter_dir, base=tiny_shapes(model_type), **load_kwargs)
    theirs = peft_deltas(adapter_dir, model_type)
    assert set(ours.weights) == set(theirs)
    for key, pair in ours.weights.items():
        delta = pair.scale * (pair.b.double() @ pair.a.double())  # [out, in]
        torch.testing.assert_close(delta, theirs[key], rtol=1e-12, atol=1e-12, msg=str(key))


ORACLE_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "r8_qv": ("llama", {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}),
    "r16_all_seven": ("llama", {"r": 16, "lora_alpha": 32, "target_modules": ALL}),
    "rslora": (
        "llama",
        {"r": 8, "lora_alpha": 16, "use_rslora": True, "target_modules": ["q_proj", "down_proj"]},
    ),
    "patterns": (
        "llama",
        {
            "r": 8,
            "lora_alpha": 16,
            "target_modules": ALL,
            # suffix, dotted suffix, anchored full name and a regex, as PEFT's get_pattern_key reads them
            "rank_pattern": {
                "q_proj": 4,
                "layers.1.mlp.down_proj": 12,
                "^model.layers.0.self_attn.k_proj": 2,
            },
            "alpha_pattern": {"v_proj": 3, r"mlp\.(up|gate)_proj": 40, "model.layers.1.self_attn.o_proj": 7},
        },
    ),
    "rslora_patterns": (
        "llama",
        {"r": 8, "lora_alpha": 8, "use_rslora": True, "target_modules": ALL, "rank_pattern": {"o_proj": 2}},
    ),
    "layers_subset": (
        "llama",
        {"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [1], "layers_pattern": "layers"},
    ),
    "layer_int_no_pattern": ("llama", {"target_modules": ["k_proj"], "layers_to_transform": 0}),
    "exclude": (
        "llama",
        {"target_modules": "all-linear", "exclude_modules": ["o_proj", "model.layers.0.mlp.up_proj"]},
    ),
    "exclude_regex": ("llama", {"target_modules": ALL, "exclude_modules": r".*layers\.1\.self_attn\..*"}),
    "regex_targets": ("llama", {"target_modules": r"model\.layers\.\d+\.(self_attn\.k|mlp\.gate)_proj"}),
    "all_linear": ("llama", {"r": 4, "target_modules": "all-linear"}),
    "qwen2": ("qwen2", {"r": 8, "lora_alpha": 16, "target_modules": ALL}),
    "mistral": ("mistral", {"r": 8, "lora_alpha": 32, "target_modules": ALL, "rank_pattern": {"q_proj": 2}}),
}


@pytest.mark.parametrize("case", list(ORACLE_CASES))
def test_matches_peft_delta(case: str, tmp_path: Path) -> None:
    model_type, lora_kwargs = ORACLE_CASES[case]
    assert_matches_peft(save_peft_adapter(tmp_path / case, model_type, **lora_kwargs), model_type)


def test_ranks_and_scales_per_module(tmp_path: Path) -> None:
    _, lora_kwargs = ORACLE_CASES["patterns"]
    adapter = load_adapter(save_peft_adapter(tmp_path / "a", **lora_kwargs), base=tiny_shapes())
    assert adapter.rank_by_module == {"q_proj": 4, "k_proj": 8, "v_proj": 8, "o_proj": 8} | {
        "gate_proj": 8,
        "up_proj": 8,
        "down_proj": 12,
    }
    assert adapter.max_rank == 12
    assert adapter.weights[(0, "k_proj")].a.shape == (2, 64)
    assert adapter.weights[(0, "v_proj")].scale == 3 / 8
    assert adapter.modules == tuple(LORA_MODULES) and adapter.layers == (0, 1)


def test_module_keys_match_transformers() -> None:
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "phi3"):
        names = [name for name, _ in tiny_model(model_type).named_modules()]
        assert module_keys(tiny_shapes(model_type)) == names


def test_a_pattern_that_selects_qwen3_q_norm_is_refused(tmp_path: Path) -> None:
    """PEFT cannot wrap an RMSNorm; a pattern reaching q_norm / k_norm is refused, not narrowed."""
    adapter_dir = save_peft_adapter(tmp_path / "a", target_modules=["q_proj", "v_proj"])
    edit_config(adapter_dir, target_modules=r".*self_attn\..*")
    with pytest.raises(AdapterFormatError, match=r"selects 'model\.layers\.0\.self_attn\.q_norm'"):
        load_adapter(adapter_dir, base=tiny_shapes("qwen3"))


def test_null_target_modules_uses_peft_defaults(tmp_path: Path) -> None:
    adapter_dir = save_peft_adapter(tmp_path / "a", target_modules=["q_proj", "v_proj"])
    edit_config(adapter_dir, target_modules=None)
    assert_matches_peft(adapter_dir)


def test_fan_in_fan_out_never_transposes_linear_factors(tmp_path: Path) -> None:
    # PEFT forces fan_in_fan_out=False on nn.Linear and saves False; a config edited to True still loads
    # A [r, in] / B [out, r] in PEFT, so the flag must not transpose anything.
    adapter_dir = save_peft_adapter(tmp_path / "a", target_modules=ALL, fan_in_fan_out=True)
    edit_config(adapter_dir, fan_in_fan_out=True)
    assert_matches_peft(adapter_dir)
    # Factors stored transposed are not loadable by PEFT either: refused, never guessed.
    edit_tensors(adapter_dir, lambda ts: {k: v.t().contiguous() for k, v in ts.items()})
    with pytest.raises(RuntimeError):
        peft_deltas(adapter_dir)
    with pytest.raises(AdapterFormatError, match=r"lora_A\.weight has shape \(64, 8\), expected \(8, 64\)"):
        load_adapter(adapter_dir, base=tiny_shapes())


def test_default_adapter_name_in_tensor_keys(tmp_path: Path) -> None:
    adapter_dir = save_peft_adapter(tmp_path / "a", target_modules=["q_proj", "v_proj"])
    reference = load_adapter(adapter_dir, base=tiny_shapes())
    edit_tensors(adapter_dir, lambda ts: {k.replace(".weight", ".default.weight"): v for k, v in ts.items()})
    renamed = load_adapter(adapter_dir, base=tiny_shapes())
    assert set(renamed.weights) == set(reference.weights)
    for key, pair in renamed.weights.items():
        assert torch.equal(pair.a, reference.weights[key].a) and torch.equal(pair.b, reference.weights[key].b)


def test_metadata_and_inference_neutral_fields_accepted(tmp_path: Path) -> None:
    adapter_dir = save_peft_adapter(tmp_path / "a", target_modules=ALL, lora_dropout=0.1)
    edit_config(
        adapter_dir,
        base_model_name_or_path="org/base",
        revision="main",
        task_type="CAUSAL_LM",
        init_lora_weights="gaussian",
        training_notes={"epochs": 3},
        use_future_thing=False,
        future_config=None,
        modules_to_save=[],
        target_parameters=None,
    )
    assert_matches_peft(adapter_dir)


def test_target_parameters_on_projection_weights_are_lora_on_them(tmp_path: Path) -> None:
    """PEFT's ParamWrapper on a 2-D weight computes F.linear(x, W + s B A): the same delta as LoRA on
    the module, with its rank and alpha patterns looked up by the parameter key."""
    adapter_dir = save_peft_adapter(
        tmp_path / "a", r=4, lora_alpha=8, target_modules=["k_proj"],
        target_parameters=["self_attn.q_proj.weight", "mlp.down_proj.weight"],
        rank_pattern={"down_proj.weight": 2}, alpha_pattern={"q_proj.weight": 3},
    )  # fmt: skip
    assert_matches_peft(adapter_dir)


def test_velora_is_training_only(tmp_path: Path) -> None:
    from peft.tuners.lora.config import VeloraConfig

    adapter_dir = save_peft_adapter(tmp_path / "a", target_modules=["q_proj"], velora_config=VeloraConfig())
    assert_matches_peft(adapter_dir)


@pytest.mark.parametrize("saved", [torch.float16, torch.bfloat16])
def test_half_precision_adapters(saved: torch.dtype, tmp_path: Path) -> None:
    adapter_dir = save_peft_adapter(tmp_path / "a", target_modules=["q_proj", "v_proj"], dtype=saved)
    assert_matches_peft(adapter_dir)
    half = load_adapter(adapter_dir, base=tiny_shapes(), dtype=torch.float16)
    assert all(p.a.dtype == p.b.dtype == torch.float16 for p in half.weights.values())


# --- refusals ----------------------------------------------------------------------------------------

PEFT_BUILT_REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "modules_to_save_norm": (
        {"target_modules": ["q_proj"], "modules_to_save": ["act_fn"]},
        "merge the adapter",
    ),
    "bias_lora_only": ({"target_modules": ["q_proj"], "bias": "lora_only"}, "bias='lora_only'"),
    "bias_all": ({"target_modules": ["q_proj"], "bias": "all"}, "bias='all'"),
    "lora_bias": ({"target_modules": ["q_proj"], "lora_bias": True}, "lora_bias"),
    "trainable_tokens": (
        {"target_modules": ["q_proj"], "trainable_token_indices": [1, 2]},
        "trainable_token",
    ),
    "layer_replication": (
        {"target_modules": ["q_proj"], "layer_replication": [[0, 2], [1, 2]]},
        "layer_replication",
    ),
    "alora": ({"target_modules": ["q_proj"], "alora_invocation_tokens": [1, 2]}, "alora_invocation_tokens"),
    "unknown_module_name": ({"target_modules": ["q_proj", "foo_proj"]}, "'foo_proj' names no module"),
    "regex_hits_layernorm": ({"target_modules": r".*\.(q_proj|input_layernorm)"}, "input_layernorm"),
}


@pytest.mark.parametrize("case", list(PEFT_BUILT_REFUSALS))
def test_refuses_peft_built_feature(case: str, tmp_path: Path) -> None:
    lora_kwargs, cause = PEFT_BUILT_REFUSALS[case]
    try:
        adapter_dir = save_peft_adapter(tmp_path / case, **lora_kwargs)
    except (
        ValueError,
        TypeError,
    ):  # peft itself cannot build it on Linear (layernorm): hand-write the config
        adapter_dir = save_peft_adapter(tmp_path / case, target_modules=["q_proj"])
        edit_config(adapter_dir, **lora_kwargs)
    with pytest.raises(AdapterFormatError, match=cause):
        load_adapter(adapter_dir, base=tiny_shapes())


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """r=8 on q/v of both layers; copied by each hand-edit case."""
    return save_peft_adapter(tmp_path_factory.mktemp("ref") / "a", target_modules=["q_proj", "v_proj"])


def _drop_layer1_v(ts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in ts.items() if "layers.1.self_attn.v_proj" not in k}


def _add_layer2(ts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return ts | {k.replace("layers.1.", "layers.2."): v.clone() for k, v in ts.items() if "layers.1." in k}


CONFIG_REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "peft_type": ({"peft_type": "LOHA"}, "peft_type='LOHA'"),
    "use_qalora": ({"use_qalora": True}, "use_qalora"),
    "megatron": ({"megatron_config": {"tensor_model_parallel_size": 2}}, "megatron_config"),
    "pissa_init": ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights='pissa_niter_4' rewrites"),
    "loftq_init": ({"init_lora_weights": "loftq"}, "init_lora_weights='loftq' rewrites"),
    "unknown_variant_flag": ({"use_magic": True}, "use_magic"),
    "unknown_variant_config": ({"magic_config": {"k": 1}}, "magic_config"),
    "task_type": ({"task_type": "SEQ_CLS"}, "task_type='SEQ_CLS'"),
    "layers_beyond_model": (
        {"layers_to_transform": [0, 5]},
        r"layers_to_transform=\[0, 5\] names layers \[5\]",
    ),
    "layers_pattern_alone": ({"layers_pattern": "layers"}, "without layers_to_transform"),
    "layers_pattern_mismatch": ({"layers_to_transform": [0], "layers_pattern": "h"}, "targets no projection"),
    "layers_with_regex": (
        {"target_modules": ".*q_proj", "layers_to_transform": [0]},
        "target_modules is a str",
    ),
    "bad_regex": ({"rank_pattern": {"q_proj(": 4}}, "rank_pattern: invalid regular expression"),
    "rank_mismatch": ({"r": 4}, r"has shape \(8, 64\), expected \(4, 64\)"),
    "rank_pattern_mismatch": (
        {"rank_pattern": {"v_proj": 16}},
        r"v_proj.lora_B.weight has shape|v_proj.lora_A",
    ),
    "r_not_int": ({"r": 8.0}, "r=8.0"),
    "excluded_but_tensors_present": (
        {"exclude_modules": ["v_proj"]},
        "v_proj', which adapter_config.json does not",
    ),
    "untargeted_tensors": (
        {"target_modules": ["q_proj"]},
        "self_attn.v_proj', which adapter_config.json does not",
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_REFUSALS))
def test_refuses_config(case: str, reference_dir: Path, tmp_path: Path) -> None:
    changes, cause = CONFIG_REFUSALS[case]
    adapter_dir = Path(shutil.copytree(reference_dir, tmp_path / case))
    edit_config(adapter_dir, **changes)
    with pytest.raises(AdapterFormatError, match=cause):
        load_adapter(adapter_dir, base=tiny_shapes())


TENSOR_REFUSALS: dict[str, tuple[Any, str]] = {
    "targeted_but_missing": (_drop_layer1_v, r"targets 'model.layers.1.self_attn.v_proj' but tensors"),
    "layer_that_does_not_exist": (_add_layer2, "is for layer 2, which does not exist"),
    "unprefixed_names": (
        lambda ts: {k.removeprefix("base_model.model."): v for k, v in ts.items()},
        "an unknown tensor",
    ),
    "unknown_module_tensor": (
        lambda ts: (
            ts | {"base_model.model.model.layers.0.self_attn.rope_proj.lora_A.weight": torch.zeros(8, 64)}
        ),
        "rope_proj', which adapter_config.json does not target",
    ),
    "dora_magnitude": (
        lambda ts: (
            ts | {"base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(64)}
        ),
        "DoRA magnitude",
    ),
    "lora_b_bias": (
        lambda ts: ts | {"base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias": torch.ones(64)},
        "bias",
    ),
    "float64": (lambda ts: {k: v.double() for k, v in ts.items()}, "dtype 'F64'"),
}


@pytest.mark.parametrize("case", list(TENSOR_REFUSALS))
def test_refuses_tensors(case: str, reference_dir: Path, tmp_path: Path) -> None:
    edit, cause = TENSOR_REFUSALS[case]
    adapter_dir = Path(shutil.copytree(reference_dir, tmp_path / case))
    edit_tensors(adapter_dir, edit)
    with pytest.raises(AdapterFormatError, match=cause):
        load_adapter(adapter_dir, base=tiny_shapes())


def test_refuses_unknown_architecture(reference_dir: Path) -> None:
    with pytest.raises(AdapterFormatError, match="model_type='gpt2'"):
        load_adapter(reference_dir, base=tiny_shapes("gpt2"))
