"""Top-k routing for a mixture-of-experts layer, and the gather / scatter around the grouped GEMM.

softmax over the router logits in fp32 -> top-k -> optional renormalisation (transformers' Qwen2-MoE,
Qwen3-MoE `norm_topk_prob`, Mixtral always). The (token, expert) pairs are sorted by expert id once per
layer (a stable sort: inside one expert, pairs keep token order), so every expert's rows are one
contiguous segment. `combine` adds each pair's output back into its token in a fixed order (pair
order, by token then by top-k slot), so a row's sum never depends on the other rows in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class Routing:
    token_ids: Tensor  # [T * k] int64: the token of each pair, pairs sorted by expert
    gates: Tensor  # [T * k] fp32: each sorted pair's routing weight
    expert_offsets: Tensor  # [E + 1] int64: the pairs of expert e are offsets[e]:offsets[e + 1]
    order: Tensor  # [T * k] int64: sorted position -> position in token-major pair order
    experts: Tensor  # [T * k] int64: each sorted pair's expert (ascending)
    num_tokens: int
    top_k: int


def route(router_logits: Tensor, top_k: int, renormalize: bool) -> Routing:
    """router_logits [T, E] -> the sorted pairs of every token's top-k experts."""
    num_tokens, num_experts = router_logits.shape
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    flat_experts = experts.reshape(-1)
    order = torch.sort(flat_experts, stable=True).indices
    counts = torch.bincount(flat_experts, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=router_logits.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return Routing(
        token_ids=torch.div(order, top_k, rounding_mode="floor"),
        gates=weights.reshape(-1)[order],
        expert_offsets=offsets,
        order=order,
        experts=flat_experts[order],
        num_tokens=num_tokens,
        top_k=top_k,
    )


def combine(expert_out: Tensor, routing: Routing, gate_dtype: torch.dtype) -> Tensor:
    """expert_out [T * k, H] in sorted order -> [T, H]: sum over each token's k pairs of gate * output.

    The gates are cast to `gate_dtype` first (transformers casts them to the router's dtype on Qwen, keeps
    fp32 on Mixtral); the k products of a token are summed slot by slot, the same order for every row.
    """
    weighted = expert_out * routing.gates.to(gate_dtype)[:, None]  # fp32 gates on 16-bit outputs: fp32
    unsorted = torch.empty_like(expert_out)
    unsorted[routing.order] = weighted.to(expert_out.dtype)
    per_token = unsorted.view(routing.num_tokens, routing.top_k, -1)
    out = per_token[:, 0].clone()
    for slot in range(1, routing.top_k):
        out += per_token[:, slot]
    return out
