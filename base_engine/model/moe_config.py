"""Mixture-of-experts fields of Qwen3-MoE, Qwen2-MoE and Mixtral config.json, read as transformers 5's
`Qwen3MoeConfig`, `Qwen2MoeConfig` and `MixtralConfig` read them (defaults included).

- Qwen3-MoE / Qwen2-MoE: `num_experts`, `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`
  (renormalise the top-k weights), and which layers are sparse: layer i is when i is not in
  `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0 (the others keep a dense MLP of
  `intermediate_size`). Qwen2-MoE adds a shared expert of `shared_expert_intermediate_size` whose output
  is scaled by sigmoid(`shared_expert_gate`(x)).
- Mixtral: `num_local_experts`, `num_experts_per_tok`, every layer sparse with experts of
  `intermediate_size`, top-k weights always renormalised and kept in fp32 when combined.

Returns plain values (`MoeConfig`); config.py places it on `ModelConfig.moe`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

MOE_ARCHITECTURES: dict[str, str] = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
}
# transformers' class defaults of the fields a config.json may leave out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    "qwen2_moe": {
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
    },
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
}


@dataclass(frozen=True, slots=True)
class MoeConfig:
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    renormalize: bool  # divide the top-k weights by their sum
    sparse_layers: tuple[bool, ...]  # per layer: routed experts (True) or a dense MLP
    shared_expert_intermediate_size: int | None = None  # Qwen2-MoE's gated shared expert
    fp32_gates: bool = False  # Mixtral keeps the routing weights in fp32; Qwen casts them to the model dtype
    checkpoint_prefix: str = "mlp"  # where per-expert checkpoints keep the block (Mixtral: block_sparse_moe)

    def __post_init__(self) -> None:
        if self.num_experts <= 0 or not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in 1..num_experts={self.num_experts}")
        if self.expert_intermediate_size <= 0:
            raise ValueError(f"expert intermediate size {self.expert_intermediate_size} must be > 0")


def _int(fields: dict[str, Any], key: str, path: Path) -> int:
    value = fields.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{path}: {key} must be an int; found {value!r}")
    return value


def moe_config(raw: dict[str, Any], model_type: str, num_layers: int, path: Path) -> MoeConfig | None:
    """The MoE block of a config.json (None for the dense families)."""
    if model_type not in _DEFAULTS:
        return None
    fields = {**_DEFAULTS[model_type], **{k: v for k, v in raw.items() if v is not None}}
    # transformers 5 writes `num_local_experts` for all three (attribute_map);
    # published Qwen files write `num_experts`.
    experts_key = "num_local_experts" if "num_local_experts" in raw else "num_experts"
    fields.setdefault(experts_key, fields.get("num_experts", fields.get("num_local_experts")))
    if model_type == "mixtral":
        return MoeConfig(
            num_experts=_int(fields, experts_key, path),
            top_k=_int(fields, "num_experts_per_tok", path),
            expert_intermediate_size=_int(fields, "intermediate_size", path),
            renormalize=True,
            sparse_layers=(True,) * num_layers,
            fp32_gates=True,
            checkpoint_prefix="block_sparse_moe",
        )
    step = _int({"s": fields.get("decoder_sparse_step", 1)}, "s", path)
    dense = fields.get("mlp_only_layers") or []
    if step <= 0 or not isinstance(dense, list):
        raise ValueError(f"{path}: decoder_sparse_step={step} / mlp_only_layers={dense!r} malformed")
    num_experts = _int(fields, experts_key, path)
    sparse = tuple(i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    return MoeConfig(
        num_experts=num_experts,
        top_k=_int(fields, "num_experts_per_tok", path),
        expert_intermediate_size=_int(fields, "moe_intermediate_size", path),
        renormalize=bool(fields.get("norm_topk_prob", False)),
        sparse_layers=sparse,
        shared_expert_intermediate_size=(
            _int(fields, "shared_expert_intermediate_size", path) if model_type == "qwen2_moe" else None
        ),
    )


def moe_sliding_window(raw: dict[str, Any], model_type: str, path: Path) -> int | None:
    """Mixtral slides every layer when `sliding_window` is set; Qwen3-MoE every layer with
    `use_sliding_window`; Qwen2-MoE's alternating windowed layers are refused."""
    if model_type == "mixtral":
        return raw.get("sliding_window")
    if not raw.get("use_sliding_window", False):
        return None
    if model_type == "qwen3_moe":
        return int(raw.get("sliding_window") or 4096)
    raise ValueError(
        f"{path}: use_sliding_window on {model_type} (windows on alternating layers below max_window_layers) "
        "unsupported; set use_sliding_window false"
    )
