"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3; Gemma 2/3 with the pieces of gemma.py; the MoE
families with the block of moe.py) over a paged KV cache.

Module and parameter names mirror the Hugging Face checkpoints, except that q/k/v and gate/up are
packed into one projection each (one matmul instead of three/two); `PACKED` maps checkpoint names to
(packed name, slice index) so loading stays a small mapping.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from base_engine.invariant import invariant_linear
from base_engine.model.config import ModelConfig
from base_engine.model.gated import gated
from base_engine.model.gemma import GemmaDecoderLayer, GemmaRMSNorm, embed_scale, softcap
from base_engine.model.moe import SparseMoeBlock
from base_engine.model.norm_rows import normed
from base_engine.model.rope import apply_rope
from base_engine.runner.attention import AttentionMetadata, attend, write_kv

# checkpoint module -> (packed module, index of its slice)
PACKED: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


# On CPU the LM head runs in vocabulary chunks: one GEMM per LOGITS_CHUNK rows of the weight keeps
# its [rows, chunk] output tile in L2, where one [rows, vocab] GEMM streams a vocab-wide output
# through memory. bench-small (hidden 512, vocab 32000, 2 threads): 64 rows 56 ms -> 27 ms,
# 8 rows 23 -> 15 ms, 256 rows 110 -> 90 ms; 1 row unchanged (it is a weight-bandwidth GEMV).
LOGITS_CHUNK = 1024


class LoraBatch(Protocol):
    """Per-step multi-LoRA state: adds each row's adapter delta to a projection's output in place."""

    def apply(self, layer: int, projection: str, y: torch.Tensor, x: torch.Tensor) -> None: ...

    def add_embedding(self, input_ids: torch.Tensor, x: torch.Tensor, multiplier: float | None) -> None:
        """Adds each row's embedding-LoRA delta (rows whose adapter has one) to the looked-up `x`."""
        ...

    def add_lm_head(
        self, logits: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor, invariant: bool
    ) -> None:
        """Adds the lm_head-LoRA delta to `logits` (of `hidden`, the step rows `rows`) where it applies."""
        ...

    def head_groups(self, rows: torch.Tensor) -> list:
        """The sampled rows per LM-head matrix (`lora_heads.HeadGroup`s); [] when all use the base's."""
        ...

    def replace_embedding(self, input_ids: torch.Tensor, x: torch.Tensor) -> None:
        """Rows whose adapter has its own embed_tokens (modules_to_save) read it instead of the base's."""
        ...

    def apply_norm(self, norm: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        """Rows whose adapter has its own copy of `norm` (modules_to_save): y[rows] = copy(x[rows])."""
        ...

    def experts(self, layer: int, routing: Any) -> Any:
        """This layer's expert LoRA for the step's routed pairs (`lora_experts.ExpertStep`: `.apply(module,
        y, x)` adds each pair's delta), or None when no row has one there."""
        ...


def project(linear: nn.Linear, x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """`linear(x)`, or its batch-invariant form (base_engine/invariant.py) in a deterministic step."""
    return invariant_linear(x, linear.weight, linear.bias) if invariant else linear(x)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in fp32 and cast back, as the HF reference does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.softcap = config.attn_logit_softcapping
        self.window = config.layer_window(layer)  # None: full attention
        out = self.q_size + 2 * self.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, out, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        # q/k norm (ModelConfig.qk_norm): one RMSNorm over head_dim shared by all heads (Gemma's
        # (1 + weight) form on Gemma 3).
        self.q_norm = _norm(config, self.head_dim) if config.qk_norm else None
        self.k_norm = _norm(config, self.head_dim) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoraBatch | None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = project(self.qkv_proj, x, meta.invariant)  # [T, q + 2 kv]
        if lora is not None:
            lora.apply(self.layer, "qkv_proj", qkv, x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KV, D]
        if self.q_norm is not None and self.k_norm is not None:  # after the LoRA deltas, before RoPE
            q, k = normed(self.q_norm, q, lora), normed(self.k_norm, k, lora)
        q = apply_rope(q, *cos_sin)
        k = apply_rope(k, *cos_sin)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        # A model mixing windowed and global layers: the windowed ones read their own metadata.
        local = meta.sliding if self.window is not None and meta.sliding is not None else meta
        attn = attend(q, k, v, kv_cache, local, self.scale, self.softcap).view(num_tokens, self.q_size)
        out = project(self.o_proj, attn, meta.invariant)
        if lora is not None:
            lora.apply(self.layer, "o_proj", out, attn)
        return out


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.is_gelu = config.hidden_act == "gelu_pytorch_tanh"  # GeGLU (Gemma); else SwiGLU

    def forward(self, x: torch.Tensor, lora: LoraBatch | None, invariant: bool = False) -> torch.Tensor:
        gate_up = project(self.gate_up_proj, x, invariant)  # [T, 2 * intermediate]
        if lora is not None:
            lora.apply(self.layer, "gate_up_proj", gate_up, x)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        hidden = gated(gate, up, gelu=self.is_gelu)
        out = project(self.down_proj, hidden, invariant)
        if lora is not None:
            lora.apply(self.layer, "down_proj", out, hidden)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = _mlp(config, layer)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoraBatch | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(normed(self.input_layernorm, x, lora), cos_sin, kv_cache, meta, lora)
        return x + self.mlp(normed(self.post_attention_layernorm, x, lora), lora, meta.invariant)


def _mlp(config: ModelConfig, layer: int) -> nn.Module:
    """Routed experts on the sparse layers of an MoE model (moe.py), else the dense MLP."""
    if config.moe is not None and config.moe.sparse_layers[layer]:
        return SparseMoeBlock(config.moe, config.hidden_size, layer)
    return MLP(config, layer)


def _norm(config: ModelConfig, size: int) -> nn.Module:
    return (
        GemmaRMSNorm(size, config.rms_norm_eps) if config.gemma_layout else RMSNorm(size, config.rms_norm_eps)
    )


def _layer(config: ModelConfig, layer: int) -> nn.Module:
    if config.gemma_layout:
        attn, mlp = Attention(config, layer), MLP(config, layer)
        return GemmaDecoderLayer(config.hidden_size, config.rms_norm_eps, attn, mlp)
    return DecoderLayer(config, layer)


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = _norm(config, config.hidden_size)


class CausalLM(nn.Module):
    """`forward` returns final hidden states for the step's tokens; `logits` projects chosen rows."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for name, module in self.named_modules():  # PEFT's module keys, for modules_to_save on norms
            if isinstance(module, (RMSNorm, GemmaRMSNorm)):
                module.peft_key = name
        # A float32 copy of the LM head when the CPU serves a 16-bit dtype (`keep_float32_logits`).
        self.head_float32: torch.Tensor | None = None

    def keep_float32_logits(self) -> None:
        """Logits computed in float32 from here on (CPU, bf16 weights): the CPU's bf16 GEMM rounds its
        output to bf16, whose 8-bit mantissa spaces logits of 16-32 by 0.125, coarser than the gap
        between the top two tokens of many greedy steps (measured on SmolLM2: 4 of 20 chat answers
        flipped at gaps of 0.01-0.08). The copy holds the same bf16-valued weights, widened."""
        self.head_float32 = self.lm_head.weight.detach().float()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # each [T, head_dim]
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        lora: LoraBatch | None = None,
        local_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,  # windowed layers' (Gemma 3)
    ) -> torch.Tensor:  # [T, hidden]
        x = self.model.embed_tokens(input_ids)
        if lora is not None:
            lora.replace_embedding(input_ids, x)
        multiplier = None
        if self.config.gemma_layout:
            multiplier = embed_scale(self.config.hidden_size, x.dtype)
            x = x * multiplier
        if lora is not None:
            lora.add_embedding(input_ids, x, multiplier)
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            is_local = local_cos_sin is not None and layer.self_attn.window is not None
            x = layer(x, local_cos_sin if is_local else cos_sin, kv_cache, meta, lora)
        return normed(self.model.norm, x, lora)

    @torch.inference_mode()
    def logits(
        self,
        hidden: torch.Tensor,
        invariant: bool = False,
        lora: LoraBatch | None = None,
        rows: torch.Tensor | None = None,  # the step rows of `hidden`, for the LoRA slots
    ) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32 (with each row's lm_head LoRA, before the soft-cap)."""
        weight = self.lm_head.weight  # [vocab, hidden]
        if self.head_float32 is not None:
            hidden, weight = hidden.float(), self.head_float32
        groups = [] if lora is None or rows is None else lora.head_groups(rows)
        if not groups:
            out = _head(hidden, weight, invariant)
        else:  # modules_to_save: each adapter's rows through its own head, the rest through the base's
            out = hidden.new_empty(hidden.shape[0], weight.shape[0])
            for picked, own in groups:
                head = weight if own is None else own.to(hidden.dtype)
                out.index_copy_(0, picked, _head(hidden.index_select(0, picked), head, invariant))
        cap = self.config.final_logit_softcapping
        if lora is not None and rows is not None:
            lora.add_lm_head(out, hidden, rows, invariant)
        # Capped in the model dtype, as transformers does, then widened.
        return (out if cap is None else softcap(out, cap)).float()


def _head(hidden: torch.Tensor, weight: torch.Tensor, invariant: bool) -> torch.Tensor:
    """hidden [N, hidden] @ weight [vocab, hidden]^T, in LOGITS_CHUNK vocabulary chunks on CPU."""
    vocab = weight.shape[0]
    linear = invariant_linear if invariant else F.linear
    if hidden.device.type != "cpu" or vocab <= LOGITS_CHUNK:
        return linear(hidden, weight)
    out = hidden.new_empty(hidden.shape[0], vocab)
    for start in range(0, vocab, LOGITS_CHUNK):
        chunk = slice(start, start + LOGITS_CHUNK)
        if invariant:
            out[:, chunk] = linear(hidden, weight[chunk])
        else:  # the GEMM writes its columns of `out` in place: no copy (a parallel region from 64 rows on)
            torch.mm(hidden, weight[chunk].t(), out=out[:, chunk])
    return out
