"""Rewrites a saved MoE checkpoint's per-expert tensors into transformers 5's fused 3-D layout
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I], `mlp.gate.weight`), so the
loader's second layout is tested on the same weights."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_EXPERT = re.compile(r"^(model\.layers\.\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_PARTS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def fuse_experts(path: Path) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    out: dict[str, torch.Tensor] = {}
    grouped: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, value in tensors.items():
        match = _EXPERT.match(name)
        if match is None:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = value
            continue
        layer, _, expert, part = match.groups()
        grouped.setdefault(layer, {}).setdefault(_PARTS[part], {})[int(expert)] = value
    for layer, parts in grouped.items():
        experts = sorted(parts["gate"])
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts["gate"][e], parts["up"][e]]) for e in experts]
        ).contiguous()
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([parts["down"][e] for e in experts]).contiguous()
    save_file(out, file, metadata={"format": "pt"})
