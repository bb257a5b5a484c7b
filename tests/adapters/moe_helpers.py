"""The PEFT adapters the MoE LoRA tests share (tests/adapters/test_moe_lora.py, the isolation test)."""

from __future__ import annotations

from pathlib import Path

from base_engine.model.config import load_model_config
from tests.adapters.engine_helpers import make_adapter

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def moe_adapters(model_dir: Path, out: Path) -> dict[str, Path]:
    """attention only; experts only (r 8); both, with a rank pattern on the down tensor and an alpha
    pattern on q_proj, and (where the family has them) the dense layers' MLP and Qwen2-MoE's shared
    expert through target_parameters on their weights: PEFT converts MLP names in target_modules into
    the expert tensors on these families (its transformers-v5 MoE conversion), so the weights are the
    one way to reach a dense or shared MLP."""
    base = load_model_config(model_dir).base_shapes()
    has_mlp = any(base.has_mlp(layer) for layer in range(base.num_layers))
    mlp = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"] if has_mlp else []
    return {
        "attn": make_adapter(model_dir, out / "attn", seed=1, r=4, lora_alpha=8, target_modules=ATTENTION),
        "experts": make_adapter(
            model_dir,
            out / "experts",
            seed=2,
            r=8,
            lora_alpha=16,
            target_modules=[],
            target_parameters=EXPERTS,
        ),  # fmt: skip
        "both": make_adapter(
            model_dir,
            out / "both",
            seed=3,
            r=4,
            lora_alpha=4,
            target_modules=ATTENTION,
            target_parameters=EXPERTS + mlp,
            rank_pattern={"experts.down_proj": 8},
            alpha_pattern={"q_proj": 12},
        ),  # fmt: skip
        # PEFT's transformers-v5 conversion turns all-linear into attention, the router's weight, the
        # expert tensors (and Qwen2-MoE's shared-expert gate)
        "linear": make_adapter(
            model_dir, out / "linear", seed=4, r=4, lora_alpha=8, target_modules="all-linear"
        ),
    }
