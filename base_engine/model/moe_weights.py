"""Expert weights from either checkpoint layout into moe.py's fused parameters.

- fused (transformers 5's in-memory layout): `mlp.experts.gate_up_proj` [E, 2I, H],
  `mlp.experts.down_proj` [E, H, I], `mlp.gate.weight`; loaded as they are.
- per expert (what `save_pretrained` writes, and the published checkpoints):
  `mlp.experts.<e>.{gate,up,down}_proj.weight` (Qwen2-/Qwen3-MoE) or
  `block_sparse_moe.experts.<e>.{w1,w3,w2}.weight` with `block_sparse_moe.gate.weight` (Mixtral);
  stacked over e, gate above up.
A layer with some experts missing is an error naming the first missing tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from base_engine.model.checkpoint import CheckpointReader, MissingTensorError
from base_engine.model.config import ModelConfig

# our fused parameter -> the per-expert tensors it stacks, per family naming (Mixtral's w1 / w3 / w2)
_PER_EXPERT = {
    "gate_up_proj": {"mlp": ("gate_proj", "up_proj"), "block_sparse_moe": ("w1", "w3")},
    "down_proj": {"mlp": ("down_proj",), "block_sparse_moe": ("w2",)},
}


def moe_tensor(
    name: str,
    config: ModelConfig,
    reader: CheckpointReader,
    rename: Callable[[str], str],
    dtype: torch.dtype,
) -> tuple[torch.Tensor, list[str]] | None:
    """The value of an MoE parameter and the checkpoint tensors it came from; None for other params."""
    moe = config.moe
    if moe is None or ".mlp.experts." not in name and not name.endswith(".mlp.gate.weight"):
        return None
    fused = rename(name)
    if fused in reader:
        return reader.get(fused, dtype=dtype), [fused]
    prefix = moe.checkpoint_prefix
    layer_prefix = name.split(".mlp.")[0]  # model.layers.<i>
    if name.endswith(".mlp.gate.weight"):
        router = rename(f"{layer_prefix}.{prefix}.gate.weight")
        _require(router, reader, config, fused)
        return reader.get(router, dtype=dtype), [router]
    param = name.rsplit(".", 1)[1]  # gate_up_proj | down_proj
    sources: list[str] = []
    experts = []
    for expert in range(moe.num_experts):
        parts = []
        for part in _PER_EXPERT[param][prefix]:
            src = rename(f"{layer_prefix}.{prefix}.experts.{expert}.{part}.weight")
            _require(src, reader, config, fused)
            parts.append(reader.get(src, dtype=dtype))
            sources.append(src)
        experts.append(torch.cat(parts, dim=0))
    return torch.stack(experts), sources


def _require(src: str, reader: CheckpointReader, config: ModelConfig, fused: str) -> None:
    if src not in reader:
        raise MissingTensorError(
            f"tensor {src!r} (or the fused {fused!r}) missing from checkpoint (files: {reader.files()}); "
            f"{config.architecture} with {config.moe.num_experts if config.moe else 0} experts needs it"
        )
