"""`adapters.types.BaseWeights` over the served model: what adapter loading reads of the base weights
(DoRA's norms, the coverage report's ||W||_F, the embedding / LM head an adapter's saved copy must equal).

Checkpoint projections are row views of the packed q/k/v and gate/up weights. On an MoE layer gate/up/down
are Qwen2-MoE's shared expert's, and the expert tensors' norms are taken over all experts.
"""

from __future__ import annotations

import torch
from torch import nn

from adapters.types import EXPERT_MODULES, LORA_MODULES
from base_engine.model.decoder import PACKED, CausalLM

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


class ModelWeights:
    def __init__(self, model: CausalLM) -> None:
        self.model = model

    def _parent(self, layer: int, module: str) -> nn.Module | None:
        block = self.model.model.layers[layer]
        if module in _ATTENTION:
            return block.self_attn
        mlp = block.mlp
        if hasattr(mlp, "experts"):  # an MoE layer: gate/up/down only on a shared expert
            return getattr(mlp, "shared_expert", None)
        return mlp

    def _rows(self, layer: int, module: str) -> tuple[nn.Linear, slice]:
        parent = self._parent(layer, module)
        if parent is None:
            raise KeyError(f"layer {layer} has no {module} (its MLP is routed to experts)")
        packed, index = PACKED.get(module, (module, 0))
        linear = getattr(parent, packed)
        sizes = [parent.q_size, parent.kv_size, parent.kv_size] if packed == "qkv_proj" else None
        if packed == "gate_up_proj":
            sizes = [parent.intermediate_size] * 2
        if sizes is None:
            return linear, slice(None)
        start = sum(sizes[:index])
        return linear, slice(start, start + sizes[index])

    def weight(self, layer: int, module: str) -> torch.Tensor:
        linear, rows = self._rows(layer, module)
        return linear.weight.detach()[rows]

    def bias(self, layer: int, module: str) -> torch.Tensor | None:
        linear, rows = self._rows(layer, module)
        return None if linear.bias is None else linear.bias.detach()[rows]

    def embedding(self) -> torch.Tensor:
        return self.model.model.embed_tokens.weight.detach()

    def lm_head(self) -> torch.Tensor:
        return self.model.lm_head.weight.detach()

    @torch.no_grad()
    def frobenius_norms(self) -> dict[tuple[int, str], float]:
        """||W||_F in float64 per (layer, checkpoint projection or expert tensor), and of the input
        embedding as (-1, "embed_tokens") and the LM head as (-1, "lm_head"): fixed for the engine's life."""
        norms = {}
        for layer, block in enumerate(self.model.model.layers):
            for module in LORA_MODULES:
                if self._parent(layer, module) is not None:
                    norms[(layer, module)] = float(torch.linalg.norm(self.weight(layer, module).double()))
            for gate, name in (("router", "gate"), ("shared_expert_gate", "shared_expert_gate")):
                linear = getattr(block.mlp, name, None) if hasattr(block.mlp, "experts") else None
                if linear is not None:
                    norms[(layer, gate)] = float(torch.linalg.norm(linear.weight.detach().double()))
            experts = getattr(block.mlp, "experts", None)
            for module in EXPERT_MODULES if experts is not None else ():
                tensor = getattr(experts, module.removeprefix("experts.")).detach()
                norms[(layer, module)] = float(torch.linalg.norm(tensor.double()))
        norms[(-1, "embed_tokens")] = float(torch.linalg.norm(self.embedding().double()))
        norms[(-1, "lm_head")] = float(torch.linalg.norm(self.lm_head().double()))
        return norms
