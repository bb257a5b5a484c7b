"""The largest legal adapter for a base model: what an upload may weigh, derived, not guessed.

A legal adapter targets at most the seven projections of every layer (with DoRA, a magnitude vector
[out] beside each), the input embedding (`lora_embedding_A` [r, vocab], `lora_embedding_B` [hidden, r])
and the LM head (`lora_A` [r, hidden], `lora_B` [vocab, r]), and on an MoE model both expert tensors
of every sparse layer (E factor pairs each, or three per expert as transformers 4 saved them) and its
gates, each at rank <= `max_lora_rank`. Some of these exclude each other (DoRA refuses
target_parameters, per-expert modules and the embedding/head); the bound adds them all, so it is never
below a legal file. Its widest legal dtype is fp32 (F32, F16 and BF16 are accepted).
Whole-module copies are bounded apart (`max_replacement_file_bytes`): embed_tokens and lm_head hold
at most one [vocab, hidden] matrix each in the file (a `modules_to_save` copy, or the base weight PEFT
saves beside a LoRA on the module, checked against the served one at load), norms their weight vectors.
The header is one JSON entry per tensor plus free-form `__metadata__`, which `HEADER_BASE_BYTES` +
`HEADER_BYTES_PER_TENSOR` per tensor bound generously.
"""

from __future__ import annotations

from adapters.peft_targets import module_keys
from adapters.replacements import REPLACEABLE, replaceable_norm, replacement_shape
from adapters.types import LORA_MODULES, MOE_GATES, BaseModelShapes

FP32_BYTES = 4
HEADER_BASE_BYTES = 64 << 10  # the 8-byte length, braces and `__metadata__`
HEADER_BYTES_PER_TENSOR = 256  # '"base_model.model.model.layers.127.mlp.down_proj.lora_A.weight":{...}'


def max_adapter_weights_bytes(base: BaseModelShapes, max_lora_rank: int) -> int:
    """Bytes of the largest legal `adapter_model.safetensors` without whole-module copies: in fp32, all
    seven projections of every layer at `max_lora_rank` (A [r, in] and B [out, r]) with DoRA's magnitude
    [out] each, embedding and lm_head LoRA, and on MoE bases every expert's and gate's factors; plus the
    header."""
    if max_lora_rank <= 0:
        raise ValueError(f"max_lora_rank must be positive, got {max_lora_rank}")
    r = max_lora_rank
    elements = 0
    for layer in range(base.num_layers):  # a sparse layer's MLP projections: its shared expert, if any
        shapes = [base.module_shape(m, layer if base.has_mlp(layer) else None) for m in LORA_MODULES]
        elements += sum(r * (h_in + h_out) + h_out for h_in, h_out in shapes)  # A, B and the magnitude
    num_tensors = 3 * len(LORA_MODULES) * base.num_layers
    elements += 2 * r * (base.vocab_size + base.hidden_size)  # embed_tokens and lm_head LoRA
    num_tensors += 4
    if base.moe is not None:  # LoRA on every expert of every sparse layer, in the larger of two layouts:
        # transformers 5's fused tensors (gate_up [r, H] + [2I, r], down [r, I] + [H, r] per expert) or
        # transformers 4's per-expert gate/up/down (3 pairs: r (3H + 3I) per expert, experts_v4.py)
        sparse, size = sum(base.moe.sparse_layers), base.moe.expert_intermediate_size
        elements += sparse * base.moe.num_experts * r * 3 * (base.hidden_size + size)
        for gate in MOE_GATES:  # the router and Qwen2-MoE's shared-expert gate, with a magnitude each
            hidden_in, hidden_out = base.module_shape(gate)
            elements += sparse * (r * (hidden_in + hidden_out) + hidden_out)
        num_tensors += (6 * base.moe.num_experts + 3 * len(MOE_GATES)) * sparse
    return elements * FP32_BYTES + HEADER_BASE_BYTES + num_tensors * HEADER_BYTES_PER_TENSOR


def max_replacement_file_bytes(base: BaseModelShapes, max_replacement_bytes: int) -> int:
    """What legal whole-module copies add to the file, in fp32: one [vocab, hidden] matrix each for
    lm_head and embed_tokens (a `modules_to_save` copy, or PEFT's saved base weight beside a LoRA on it,
    which no budget bounds), and the norms' copies (no more than twice their serving-dtype budget, an
    fp32 file of 16-bit copies); plus their header entries."""
    norms = [k for k in module_keys(base) if replaceable_norm(k)]
    norm_elements = sum(replacement_shape(k, base)[0] for k in norms)
    matrices = len(REPLACEABLE) * base.vocab_size * base.hidden_size * FP32_BYTES
    copies = matrices + min(norm_elements * FP32_BYTES, 2 * max_replacement_bytes)
    return copies + (len(REPLACEABLE) + len(norms)) * HEADER_BYTES_PER_TENSOR
