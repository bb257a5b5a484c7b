"""The pieces where Gemma 2 / Gemma 3 (Google DeepMind, "Gemma 2" 2024, "Gemma 3" 2025 technical reports)
differ from the Llama decoder, with the float operations of transformers' Gemma2/Gemma3 modules:

  * RMSNorm scaling by (1 + weight), computed in fp32 and cast back after the scale (Llama casts
    before it);
  * a decoder layer with a norm before and after both attention and the MLP ("sandwich" norms);
  * token embeddings times sqrt(hidden_size), that factor first rounded to the model's dtype
    (bf16: sqrt(3072) = 55.43 -> 55.5);
  * tanh soft-capping, cap * tanh(x / cap), of attention scores (base_engine/runner/attention.py and
    kernels.attention) and of the final logits.

Attention and the MLP themselves are decoder.py's (GeGLU is its MLP with the tanh GELU); this module
takes them as arguments rather than importing decoder.py.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from base_engine.model.norm_rows import normed


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight): the checkpoint stores the scale minus one (zeros = identity)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GemmaDecoderLayer(nn.Module):
    """x += post_attention_norm(attn(input_norm(x)));
    x += post_feedforward_norm(mlp(pre_feedforward_norm(x)))."""

    def __init__(self, hidden_size: int, eps: float, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps)

    def forward(self, x: torch.Tensor, cos_sin, kv_cache, meta, lora) -> torch.Tensor:
        attn = self.self_attn(normed(self.input_layernorm, x, lora), cos_sin, kv_cache, meta, lora)
        x = x + normed(self.post_attention_layernorm, attn, lora)
        mlp = self.mlp(normed(self.pre_feedforward_layernorm, x, lora), lora, meta.invariant)
        return x + normed(self.post_feedforward_layernorm, mlp, lora)


@functools.cache
def embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """sqrt(hidden_size) rounded to `dtype`, as a Python float (no tensor is made inside a step)."""
    return float(torch.tensor(hidden_size**0.5, dtype=dtype, device="cpu"))


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): values squashed smoothly into (-cap, cap)."""
    return torch.tanh(x / cap) * cap
