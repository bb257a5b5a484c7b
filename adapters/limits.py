"""The largest legal adapter for a base model: what an upload may weigh, derived, not guessed.

A legal adapter targets at most the seven projections of every layer (and on an MoE model both expert
tensors of every sparse layer, E factor pairs each), each at rank <= `max_lora_rank`;
its widest legal dtype is fp32 (F32, F16 and BF16 are accepted). Its safetensors file is therefore at
most the fp32 factors of all of them plus a header (one JSON entry per tensor, and free-form
`__metadata__`), which `HEADER_BASE_BYTES` + `HEADER_BYTES_PER_TENSOR` per tensor bound generously.
"""

from __future__ import annotations

from adapters.types import EXPERT_MODULES, LORA_MODULES, MOE_GATES, BaseModelShapes

FP32_BYTES = 4
HEADER_BASE_BYTES = 64 << 10  # the 8-byte length, braces and `__metadata__`
HEADER_BYTES_PER_TENSOR = 256  # '"base_model.model.model.layers.127.mlp.down_proj.lora_A.weight":{...}'


def max_adapter_weights_bytes(base: BaseModelShapes, max_lora_rank: int) -> int:
    """Bytes of the largest legal `adapter_model.safetensors`: all seven projections of every layer at
    `max_lora_rank` in fp32 (A [r, in] and B [out, r] each), plus its header."""
    if max_lora_rank <= 0:
        raise ValueError(f"max_lora_rank must be positive, got {max_lora_rank}")
    per_layer = sum(sum(base.module_shape(m)) for m in LORA_MODULES) * max_lora_rank
    num_tensors = 2 * len(LORA_MODULES) * base.num_layers
    elements = per_layer * base.num_layers
    if base.moe is not None:  # LoRA on the expert tensors: E factor pairs each, on every sparse layer
        sparse = sum(base.moe.sparse_layers)
        for module in EXPERT_MODULES:
            num_experts, hidden_in, hidden_out = base.expert_shape(module)
            elements += sparse * num_experts * max_lora_rank * (hidden_in + hidden_out)
        for gate in MOE_GATES:  # the router and Qwen2-MoE's shared-expert gate
            elements += sparse * max_lora_rank * sum(base.module_shape(gate))
        num_tensors += 2 * (len(EXPERT_MODULES) + len(MOE_GATES)) * sparse
    return elements * FP32_BYTES + HEADER_BASE_BYTES + num_tensors * HEADER_BYTES_PER_TENSOR


def max_replacement_file_bytes(base: BaseModelShapes, max_replacement_bytes: int) -> int:
    """What legal `modules_to_save` copies (lm_head and embed_tokens, [vocab, hidden] each) add to the
    file: both in fp32, but no more than twice their serving-dtype budget (an fp32 file of 16-bit copies)."""
    return min(2 * base.vocab_size * base.hidden_size * FP32_BYTES, 2 * max_replacement_bytes)
