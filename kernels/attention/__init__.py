"""Paged attention over the KV block pool: Triton decode/prefill kernels, a PyTorch twin (README.md)."""

from kernels.attention.api import paged_attention, paged_decode_attention, paged_prefill_attention
from kernels.attention.meta import PagedAttentionMeta, build_paged_meta

__all__ = [
    "PagedAttentionMeta",
    "build_paged_meta",
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
]
