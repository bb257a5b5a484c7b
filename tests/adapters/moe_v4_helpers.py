"""Adapters as PEFT saved them on transformers 4 for an MoE base (one nn.Linear per expert), built here
tensor by tensor (transformers 5 can no longer build that module tree), and the reference that merges
their deltas into a transformers 5 model's weights in float64."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def _sparse(cfg: dict, layer: int) -> bool:
    if cfg["model_type"] == "mixtral":
        return True
    step = cfg.get("decoder_sparse_step", 1) or 1
    return layer not in cfg.get("mlp_only_layers", []) and (layer + 1) % step == 0


def v4_linears(model_dir: Path) -> dict[str, tuple[int, int]]:
    """Every nn.Linear of the transformers-4 model (the LM head aside) -> (in, out), by module key."""
    cfg = _config(model_dir)
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    mixtral = cfg["model_type"] == "mixtral"
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    expert_size = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    out: dict[str, tuple[int, int]] = {}
    for layer in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        sizes = {"q_proj": heads * head_dim, "k_proj": kv * head_dim, "v_proj": kv * head_dim}
        for m in _ATTENTION:
            out[f"{prefix}.self_attn.{m}"] = (
                (heads * head_dim, hidden) if m == "o_proj" else (hidden, sizes[m])
            )
        if not _sparse(cfg, layer):
            out |= _swiglu(f"{prefix}.mlp", hidden, cfg["intermediate_size"], {})
            continue
        block = f"{prefix}.block_sparse_moe" if mixtral else f"{prefix}.mlp"
        out[f"{block}.gate"] = (hidden, experts)
        for e in range(experts):
            out |= _swiglu(f"{block}.experts.{e}", hidden, expert_size, _MIXTRAL if mixtral else {})
        if cfg.get("shared_expert_intermediate_size"):
            out |= _swiglu(f"{block}.shared_expert", hidden, cfg["shared_expert_intermediate_size"], {})
            out[f"{block}.shared_expert_gate"] = (hidden, 1)
    return out


def _swiglu(prefix: str, hidden: int, size: int, names: dict[str, str]) -> dict[str, tuple[int, int]]:
    shapes = {"gate_proj": (hidden, size), "up_proj": (hidden, size), "down_proj": (size, hidden)}
    return {f"{prefix}.{names.get(m, m)}": shapes[m] for m in _MLP}


def save_v4_adapter(
    model_dir: Path, out: Path, *, seed: int, target_modules: list[str], r: int, lora_alpha: float,
    rank_pattern: dict[str, int] | None = None, alpha_pattern: dict[str, float] | None = None,
    **config,
) -> Path:  # fmt: skip
    """Random lora_A / lora_B for every module a list of names selects (exact or dotted suffix, as PEFT),
    ranks and alphas by PEFT's pattern rule (the first key that is a dotted suffix of the module key)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, (fan_in, fan_out) in v4_linears(model_dir).items():
        if not any(key == t or key.endswith(f".{t}") for t in target_modules):
            continue
        rank = _pattern(rank_pattern, key, r)
        tensors[f"base_model.model.{key}.lora_A.weight"] = (
            torch.randn(rank, fan_in, generator=generator) * 0.3
        )
        tensors[f"base_model.model.{key}.lora_B.weight"] = (
            torch.randn(fan_out, rank, generator=generator) * 0.3
        )
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    fields = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": lora_alpha,
              "target_modules": target_modules, "rank_pattern": rank_pattern or {},
              "alpha_pattern": alpha_pattern or {}, "lora_dropout": 0.0, "bias": "none",
              "base_model_name_or_path": str(model_dir), **config}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(fields))
    return out


def _pattern(patterns: dict | None, key: str, default: float):
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?{pattern}$", key):
            return value
    return default


def merged_model(model_dir: Path, adapter_dir: Path):
    """The transformers 5 model in float32 with each per-module delta s * B @ A (float64) added to the
    weight it changes: a transformers-4 expert module's delta goes to its rows of the fused expert tensor
    (gate_up_proj [E, 2I, H]: gate rows, then up rows; down_proj [E, H, I])."""
    cfg_adapter = json.loads((adapter_dir / "adapter_config.json").read_text())
    from safetensors.torch import load_file

    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    params = dict(model.named_parameters())
    mixtral = _config(model_dir)["model_type"] == "mixtral"
    for name in [n for n in tensors if n.endswith(".lora_A.weight")]:
        key = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        a, b = tensors[name].double(), tensors[name.replace("lora_A", "lora_B")].double()
        rank = a.shape[0]
        scale = _pattern(cfg_adapter["alpha_pattern"], key, cfg_adapter["lora_alpha"]) / rank
        delta = scale * b @ a
        with torch.no_grad():
            _add(params, key, delta, mixtral)
    return model.eval()


def _add(params: dict, key: str, delta: torch.Tensor, mixtral: bool) -> None:
    found = re.fullmatch(r"(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)", key)
    if found is None:
        key = key.replace("block_sparse_moe", "mlp")
        params[f"{key}.weight"] += delta.float()
        return
    layer, expert, part = found.group(1), int(found.group(2)), found.group(3)
    part = {v: k for k, v in _MIXTRAL.items()}.get(part, part) if mixtral else part
    if part == "down_proj":
        params[f"{layer}.mlp.experts.down_proj"][expert] += delta.float()
        return
    size = delta.shape[0]
    rows = slice(0, size) if part == "gate_proj" else slice(size, 2 * size)
    params[f"{layer}.mlp.experts.gate_up_proj"][expert, rows] += delta.float()
