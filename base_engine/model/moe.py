"""The sparse mixture-of-experts MLP of Qwen3-MoE, Qwen2-MoE and Mixtral (config: moe_config.py).

Parameters keep transformers 5's fused layout: `gate.weight` [E, H] (the router), `experts.gate_up_proj`
[E, 2I, H] and `experts.down_proj` [E, H, I] (nn.Linear's out x in per expert), plus Qwen2-MoE's
`shared_expert` (a SwiGLU MLP, gate/up packed as in decoder.py) and `shared_expert_gate.weight` [1, H].
moe_weights.py fills them from either checkpoint layout.

One step: the router scores every token (kernels/moe/routing.py: softmax, top-k, renormalise), the
(token, expert) pairs are sorted by expert once, both expert GEMMs run grouped over those segments
(kernels/moe: Triton on CUDA, one matmul per expert with rows elsewhere), and each token sums its k
gated outputs in a fixed order. In a deterministic step every GEMM is the batch-invariant one
(base_engine/invariant.py), expert by expert.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from base_engine.invariant import invariant_linear
from base_engine.model.gated import gated
from base_engine.model.moe_config import MoeConfig
from kernels.moe import grouped_gemm
from kernels.moe.routing import combine, route


class Experts(nn.Module):
    def __init__(self, moe: MoeConfig, hidden_size: int) -> None:
        super().__init__()
        size = moe.expert_intermediate_size
        self.intermediate_size = size
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, hidden_size, size))


def _grouped(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, invariant: bool) -> torch.Tensor:
    if not invariant:
        return grouped_gemm(x, w, offsets)
    out = x.new_empty(x.shape[0], w.shape[1])
    bounds = offsets.tolist()
    for expert, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if start < end:
            out[start:end] = invariant_linear(x[start:end], w[expert], None)
    return out


# A [T, 1] tensor is one flat run of T values: PyTorch's CPU elementwise loop computes its last
# T mod (2 x vector width) values with the scalar function, whose bits differ from the vectorized one,
# so a row's sigmoid would depend on T. Widened to 64 columns every value takes the vectorized path.
_SIGMOID_WIDTH = 64


def _rowwise_sigmoid(logit: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(logit.expand(-1, _SIGMOID_WIDTH).contiguous())[:, :1]


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a SwiGLU MLP every token goes through."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora: Any, layer: int, invariant: bool) -> torch.Tensor:
        linear = invariant_linear if invariant else F.linear
        gate_up = linear(x, self.gate_up_proj.weight, None)
        if lora is not None:
            lora.apply(layer, "gate_up_proj", gate_up, x)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        hidden = gated(gate, up)
        out = linear(hidden, self.down_proj.weight, None)
        if lora is not None:
            lora.apply(layer, "down_proj", out, hidden)
        return out


class SparseMoeBlock(nn.Module):
    def __init__(self, moe: MoeConfig, hidden_size: int, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.moe = moe
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(moe, hidden_size)
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = None if shared is None else SharedExpert(hidden_size, shared)
        self.shared_expert_gate = None if shared is None else nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, lora: Any, invariant: bool = False) -> torch.Tensor:
        linear = invariant_linear if invariant else F.linear
        router_logits = linear(x, self.gate.weight, None)
        if lora is not None:  # LoRA on the router: each row routes by its own adapter's logits
            lora.apply(self.layer, "router", router_logits, x)
        routing = route(router_logits, self.moe.top_k, self.moe.renormalize)
        expert_lora = None if lora is None else lora.experts(self.layer, routing)
        rows = x[routing.token_ids]  # [T * k, H], sorted by expert
        gate_up = _grouped(rows, self.experts.gate_up_proj, routing.expert_offsets, invariant)
        if expert_lora is not None:
            expert_lora.apply("experts.gate_up_proj", gate_up, rows)
        gate, up = gate_up.split(self.experts.intermediate_size, dim=-1)
        hidden = F.silu(gate) * up
        out = _grouped(hidden, self.experts.down_proj, routing.expert_offsets, invariant)
        if expert_lora is not None:
            expert_lora.apply("experts.down_proj", out, hidden)
        y = combine(out, routing, torch.float32 if self.moe.fp32_gates else x.dtype)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            logit = linear(x, self.shared_expert_gate.weight, None)  # [T, 1]
            if lora is not None:
                lora.apply(self.layer, "shared_expert_gate", logit, x)
            scale = _rowwise_sigmoid(logit) if invariant else torch.sigmoid(logit)
            y = y + scale * self.shared_expert(x, lora, self.layer, invariant)
        return y
