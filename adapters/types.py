"""Small typed values that cross package lines: the base model's shapes, adapter identity, summaries.

`adapters` imports neither `base_engine` nor `registry`; both hand it plain values of these types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

# The seven projections a LoRA adapter may target, in the order the engine stacks them.
LORA_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Checkpoints that store q/k/v and gate/up as one projection each (transformers' Phi3): a LoRA on such a
# projection has one A and one B whose rows are the parts' outputs, in this order.
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
FUSED_MODEL_TYPES: frozenset[str] = frozenset({"phi3"})
# LoRA on a mixture-of-experts layer's fused expert tensors (PEFT `target_parameters`), per layer: one
# factor pair per expert, as `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I].
EXPERT_MODULES: tuple[str, ...] = ("experts.gate_up_proj", "experts.down_proj")
# The small linears of an MoE layer LoRA may change: the router (`mlp.gate`, [E, H]: each row's delta moves
# its own routing) and Qwen2-MoE's shared-expert gate (`mlp.shared_expert_gate`, [1, H]).
MOE_GATES: tuple[str, ...] = ("router", "shared_expert_gate")
_MLP_MODULES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")


@dataclass(frozen=True, slots=True)
class MoeShapes:
    """The mixture-of-experts part of a base model (Qwen3-MoE, Qwen2-MoE, Mixtral), as adapters see it."""

    num_experts: int
    expert_intermediate_size: int
    sparse_layers: tuple[bool, ...]  # per layer: routed experts (True) or the dense MLP
    shared_expert_intermediate_size: int | None = None  # Qwen2-MoE's shared expert (gate/up/down)


@dataclass(frozen=True, slots=True)
class BaseModelShapes:
    """What adapter validation needs to know about the base model (built by base_engine)."""

    model_type: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "gemma2" | "gemma3_text" | "gemma3" | "phi3"
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    bias_modules: tuple[str, ...] = ()  # projections with a base bias (Qwen2: q/k/v), in LORA_MODULES
    moe: MoeShapes | None = None  # set on the MoE families

    @property
    def projections(self) -> tuple[str, ...]:
        """The projections a LoRA may target on this model, as its checkpoint names them."""
        if self.model_type in FUSED_MODEL_TYPES:
            return ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        return LORA_MODULES

    def is_sparse(self, layer: int) -> bool:
        """Whether `layer` routes its MLP to experts."""
        return self.moe is not None and self.moe.sparse_layers[layer]

    def has_mlp(self, layer: int) -> bool:
        """Whether `layer` has gate/up/down projections: a dense MLP, or Qwen2-MoE's shared expert."""
        return not self.is_sparse(layer) or self.moe_shared_size is not None

    @property
    def moe_shared_size(self) -> int | None:
        return None if self.moe is None else self.moe.shared_expert_intermediate_size

    def expert_shape(self, module: str) -> tuple[int, int, int]:
        """(num_experts, in_features, out_features) of one of EXPERT_MODULES."""
        if self.moe is None:
            raise ValueError(f"{self.model_type} has no experts")
        size = self.moe.expert_intermediate_size
        shapes = {
            "experts.gate_up_proj": (self.hidden_size, 2 * size),
            "experts.down_proj": (size, self.hidden_size),
        }
        if module not in shapes:
            raise ValueError(f"unknown expert tensor {module!r}; expected one of {EXPERT_MODULES}")
        return (self.moe.num_experts, *shapes[module])

    def module_shape(self, module: str, layer: int | None = None) -> tuple[int, int]:
        """(in_features, out_features) of one projection (or fused projection), as nn.Linear sees it; with
        `layer` that layer's (on an MoE layer, gate/up/down are the shared expert's)."""
        intermediate = self.intermediate_size
        if layer is not None and self.is_sparse(layer) and module in _MLP_MODULES:
            if self.moe_shared_size is None:
                raise ValueError(f"layer {layer} of {self.model_type} routes its MLP to experts: no {module}")
            intermediate = self.moe_shared_size
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        shapes = {
            "q_proj": (self.hidden_size, q_out),
            "k_proj": (self.hidden_size, kv_out),
            "v_proj": (self.hidden_size, kv_out),
            "o_proj": (q_out, self.hidden_size),
            "gate_proj": (self.hidden_size, intermediate),
            "up_proj": (self.hidden_size, intermediate),
            "down_proj": (intermediate, self.hidden_size),
            "qkv_proj": (self.hidden_size, q_out + 2 * kv_out),
            "gate_up_proj": (self.hidden_size, 2 * intermediate),
        }
        if self.moe is not None:
            shapes |= {
                "router": (self.hidden_size, self.moe.num_experts),
                "shared_expert_gate": (self.hidden_size, 1),
            }
        if module not in shapes:
            raise ValueError(f"unknown projection {module!r}; expected one of {tuple(shapes)}")
        return shapes[module]


class BaseWeights(Protocol):
    """The served base model's projection weights, for what an adapter computes from them (DoRA's norm).

    Handed to the adapter cache by base_engine as a plain value; tensors are views, never copied."""

    def weight(self, layer: int, module: str) -> torch.Tensor:
        """[out_features, in_features] of one checkpoint projection (rows of a packed one)."""
        ...

    def bias(self, layer: int, module: str) -> torch.Tensor | None:
        """[out_features], or None when the projection has no bias."""
        ...

    def embedding(self) -> torch.Tensor:
        """[vocab, hidden] of the input embedding."""
        ...

    def lm_head(self) -> torch.Tensor:
        """[vocab, hidden] of the LM head (the input embedding itself on a tied model)."""
        ...


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """Identity of one immutable adapter version, as the engine and its caches see it.

    `id` is stable and unique (e.g. "<tenant>/<name>@<version>" in the server, the absolute path
    offline); `sha256` is the content hash of the weights file and is part of every prefix-cache key,
    so a re-uploaded adapter never reuses stale KV blocks; `source` is opaque to the engine and is
    what the `fetch(ref) -> local dir` callable understands (a directory offline, an object key set
    by the registry in the server).
    """

    id: str
    sha256: str
    source: str
    name: str = ""


class AdapterFormatError(ValueError):
    """An adapter directory the engine cannot apply exactly; the message names the field or tensor."""


class AdapterValidationError(AdapterFormatError):
    """A well-formed adapter that breaks a serving limit (rank, size) or carries non-finite values."""


@dataclass(frozen=True, slots=True)
class ModuleCoverage:
    layer: int  # -1 for the input embedding and the LM head
    module: str  # one of LORA_MODULES, or "embed_tokens" / "lm_head"
    kind: str  # "lora" | "dora" | "embedding" | "lm_head"
    rank: int
    scale: float
    delta_fro: float  # ||scale * B A||_F
    relative_delta: float | None  # delta_fro / ||W||_F; None when the base norms were not given


@dataclass(frozen=True, slots=True)
class CoverageReport:
    modules: tuple[ModuleCoverage, ...]  # by layer, then LORA_MODULES order
    kinds: tuple[str, ...]  # kinds present, e.g. ("lora",) or ("lora", "dora", "embedding")
    warning: str | None  # set when every relative delta is below NEGLIGIBLE

    def as_json(self) -> dict[str, Any]:
        """The stored and served form: modules grouped per layer."""
        layers: dict[str, dict[str, Any]] = {}
        for m in self.modules:
            layers.setdefault(m.module if m.layer < 0 else str(m.layer), {})[m.module] = {
                "kind": m.kind, "rank": m.rank, "scale": m.scale, "delta_fro": m.delta_fro,
                "relative_delta": m.relative_delta,
            }  # fmt: skip
        return {"kinds": list(self.kinds), "layers": layers, "warning": self.warning}


@dataclass(frozen=True)
class AdapterSummary:
    """What validation learned about one adapter version (stored by the registry, shown by the console)."""

    ranks: dict[str, int]  # projection name -> rank, max over layers
    modules: tuple[str, ...]  # covered projections, in LORA_MODULES order
    max_rank: int
    num_layers_covered: int
    size_bytes: int  # of adapter_model.safetensors
    sha256: str  # hex digest of adapter_model.safetensors bytes
    config_sha256: str  # hex digest of adapter_config.json bytes
    coverage: CoverageReport | None = None  # what it changes on the served model (adapters/coverage.py)
