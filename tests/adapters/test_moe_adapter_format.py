"""What an MoE adapter may target, read as PEFT saves it: the expert tensors' per-expert factors equal
PEFT's own per-expert delta; PEFT's all-linear (router and shared-expert gate included) is read whole;
the router as a module and the fused experts module in target_modules are refused by name, as are expert
tensors of the wrong shape; the expert factors count in the upload limit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from adapters.format import load_adapter
from adapters.limits import max_adapter_weights_bytes
from adapters.types import AdapterFormatError
from base_engine.model.config import load_model_config
from tests.adapters.engine_helpers import make_adapter
from tests.harness.families import CHECKPOINTS

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from base_engine.testing.checkpoint import save_random_checkpoint

    return save_random_checkpoint(tmp_path_factory.mktemp("q3moe"), **CHECKPOINTS["qwen3-moe"])


def _base(model_dir: Path):
    return load_model_config(model_dir).base_shapes()


def test_expert_factors_equal_peft_per_expert_delta(qwen3_moe: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from peft.tuners.lora.layer import ParamWrapper
    from transformers import AutoModelForCausalLM

    adapter_dir = make_adapter(qwen3_moe, tmp_path / "a", seed=5, r=4, lora_alpha=12, target_modules=[],
                               target_parameters=EXPERTS, rank_pattern={"experts.down_proj": 2})  # fmt: skip
    ours = load_adapter(adapter_dir, base=_base(qwen3_moe))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(qwen3_moe), adapter_dir).double()
    seen = 0
    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper) and "default" in module.lora_A:
            layer = int(name.split(".layers.")[1].split(".")[0])
            theirs = module.get_delta_weight("default").detach()  # [E, out, in]
            pair = ours.experts[(layer, f"experts.{module.parameter_name}")]
            delta = pair.scale * (pair.b.double() @ pair.a.double())
            torch.testing.assert_close(delta, theirs, rtol=1e-12, atol=1e-12, msg=name)
            seen += 1
    assert seen == 2 * sum(_base(qwen3_moe).moe.sparse_layers)
    assert ours.rank_by_module == {"experts.gate_up_proj": 4, "experts.down_proj": 2}


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"target_modules": ["gate"], "target_parameters": None}, "the MoE router"),
        (
            {"target_modules": ["experts"], "target_parameters": None},
            "target their tensors with target_parameters",
        ),
        ({"target_parameters": ["mlp.experts.up_proj"]}, "names no 2-D or 3-D parameter"),
        ({"use_dora": True}, "ParamWrapper does not support DoRA"),
    ],
)
def test_moe_targets_refused_by_name(qwen3_moe: Path, tmp_path: Path, changes: dict, match: str) -> None:
    adapter_dir = make_adapter(qwen3_moe, tmp_path / "a", seed=6, r=4, target_modules=["q_proj"],
                               target_parameters=EXPERTS)  # fmt: skip
    config_path = adapter_dir / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, **changes}))
    with pytest.raises(AdapterFormatError, match=match):
        load_adapter(adapter_dir, base=_base(qwen3_moe))


def test_peft_all_linear_on_moe_reaches_the_router_and_the_shared_gate(
    make_checkpoint, tmp_path: Path
) -> None:
    """On Qwen3-MoE PEFT's transformers-v5 conversion turns all-linear into attention, the router's weight
    and the expert tensors; on Qwen2-MoE it is every nn.Linear (the shared expert and its gate)."""
    for family in ("qwen3-moe", "qwen2-moe"):
        model_dir = make_checkpoint(**CHECKPOINTS[family])
        adapter_dir = make_adapter(model_dir, tmp_path / family, seed=7, r=4, target_modules="all-linear")
        adapter = load_adapter(adapter_dir, base=_base(model_dir))
        expected = {"router", "experts.gate_up_proj", "experts.down_proj", "q_proj", "o_proj"}
        if family == "qwen2-moe":  # no v5 conversion for it here: every nn.Linear, the shared gate too
            expected = {"q_proj", "o_proj", "gate_proj", "down_proj", "shared_expert_gate"}
        assert expected <= set(adapter.rank_by_module), (family, adapter.rank_by_module)


def test_mlp_names_on_an_all_sparse_model_point_at_target_parameters(make_checkpoint, tmp_path: Path) -> None:
    model_dir = make_checkpoint(**CHECKPOINTS["mixtral-window"])
    adapter_dir = make_adapter(model_dir, tmp_path / "a", seed=10, r=4, target_modules=["q_proj"])
    config_path = adapter_dir / "adapter_config.json"
    config_path.write_text(
        json.dumps({**json.loads(config_path.read_text()), "target_modules": ["q_proj", "gate_proj"]})
    )
    with pytest.raises(AdapterFormatError, match="routes its MLP to experts: target their tensors"):
        load_adapter(adapter_dir, base=_base(model_dir))


def test_expert_tensor_of_the_wrong_shape_is_refused(qwen3_moe: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    adapter_dir = make_adapter(qwen3_moe, tmp_path / "a", seed=9, r=4, target_modules=[],
                               target_parameters=["mlp.experts.down_proj"])  # fmt: skip
    path = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(path)
    key = next(k for k in tensors if k.endswith("experts.lora_A.weight"))
    tensors[key] = tensors[key][:-1].contiguous()  # one row short of r * num_experts
    save_file(tensors, path)
    with pytest.raises(AdapterFormatError, match=r"has shape \(31, 32\), expected \(32, 32\)"):
        load_adapter(adapter_dir, base=_base(qwen3_moe))


def test_upload_limit_counts_every_experts_factors(qwen3_moe: Path) -> None:
    base = _base(qwen3_moe)
    dense = max_adapter_weights_bytes(base.__class__(**{**_fields(base), "moe": None}), 8)
    moe = max_adapter_weights_bytes(base, 8)
    num_experts, hidden, inter = base.moe.num_experts, base.hidden_size, base.moe.expert_intermediate_size
    per_layer = num_experts * 8 * ((hidden + 2 * inter) + (inter + hidden)) * 4
    assert moe - dense >= per_layer * sum(base.moe.sparse_layers)


def _fields(base) -> dict:
    return {name: getattr(base, name) for name in base.__slots__}


def test_a_stray_per_expert_tensor_is_refused_by_name(qwen3_moe: Path, tmp_path: Path) -> None:
    """A transformers-4 expert tensor (served when targeted: tests/adapters/test_moe_v4_adapters.py) in an
    adapter whose config does not target that module."""
    from safetensors.torch import load_file, save_file

    adapter_dir = make_adapter(qwen3_moe, tmp_path / "a", seed=11, r=4, target_modules=["q_proj"])
    path = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(path)
    tensors["base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_A.weight"] = torch.zeros(4, 64)
    save_file(tensors, path)
    with pytest.raises(AdapterFormatError, match="experts.3.gate_proj', which adapter_config.json does not"):
        load_adapter(adapter_dir, base=_base(qwen3_moe))


def test_device_slots_count_every_experts_factors(qwen3_moe: Path) -> None:
    """The memory plan sizes the adapter pool from bytes per slot: E factor pairs per expert tensor."""
    from adapters.slots import SlotPool

    base = _base(qwen3_moe)
    moe = base.moe
    per_slot = SlotPool.bytes_per_slot(base, 8, torch.float32)
    experts = moe.num_experts * 8 * (2 * base.hidden_size + 3 * moe.expert_intermediate_size) * 4
    assert per_slot >= experts * sum(moe.sparse_layers)
    pool = SlotPool(base, num_slots=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    held = sum(
        t.numel() * t.element_size()
        for layer in pool.experts
        for s in layer.values()
        for t in s.lora_a + s.lora_b
    )
    assert held == 2 * experts * sum(moe.sparse_layers)


@pytest.mark.parametrize("family", ["qwen3-moe", "qwen2-moe"])
def test_upload_limit_holds_a_transformers_4_adapter_on_every_module(
    family: str, make_checkpoint, tmp_path
) -> None:
    """Per-expert gate/up/down pairs (transformers 4's layout, 3 pairs per expert: r (3H + 3I)) weigh more
    than the fused tensors' (r (2H + 3I)); with every attention projection, the shared expert and the
    router at the same rank, the file stays within the derived limit."""
    from tests.adapters.moe_v4_helpers import save_v4_adapter

    model_dir = make_checkpoint(**CHECKPOINTS[family])
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate"]
    directory = save_v4_adapter(model_dir, tmp_path / "v4", seed=3, target_modules=targets, r=8, lora_alpha=8)
    size = (directory / "adapter_model.safetensors").stat().st_size
    base = _base(model_dir)
    assert size <= max_adapter_weights_bytes(base, 8)
    experts = (
        sum(base.moe.sparse_layers)
        * base.moe.num_experts
        * 8
        * 3
        * (base.hidden_size + base.moe.expert_intermediate_size)
    )
    assert size > experts * 4  # the per-expert factors are most of it
