"""The model families the engine serves, as tiny random checkpoints with each family's quirks on.

`CHECKPOINTS` maps a variant name to `save_random_checkpoint` kwargs (the `make_checkpoint` fixture
takes them as they are); `FAMILIES` names one variant per family, the one with the most quirks, for
the heavier tests that run every family on every engine path (tests/base_engine/test_oracle.py,
test_batch_invariance.py, tests/adapters/test_family_lora.py). A new family adds its variants here
and its name to `FAMILIES`; sizes stay the tiny defaults (hidden 64, 2 layers, 4 heads, 2 KV heads).
"""

from __future__ import annotations

from typing import Any


def _llama3_rope(factor: float) -> dict[str, Any]:
    # original_max_position_embeddings 64: prompts + outputs reach past it, and most frequencies of a
    # 16- or 32-wide head fall in the scaled band, so a wrong scaling changes the tokens.
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }


PHI3_ORIGINAL = 32  # LongRoPE's original context in the Phi-3 checkpoint

CHECKPOINTS: dict[str, dict[str, Any]] = {
    "llama-gqa": {"arch": "llama"},
    "llama-tied": {"arch": "llama", "tie_word_embeddings": True, "seed": 3},
    # Llama 3.1-shaped: llama3 RoPE with an explicit head_dim.
    "llama3-rope-headdim": {
        "arch": "llama",
        "head_dim": 32,
        "seed": 4,
        "rope_scaling": _llama3_rope(8.0),
        "rope_theta": 500000.0,
    },
    # Llama 3.2-shaped (1B / 3B): tied embeddings and llama3 RoPE with factor 32.
    "llama3.2-tied-rope": {
        "arch": "llama",
        "tie_word_embeddings": True,
        "seed": 7,
        "rope_scaling": _llama3_rope(32.0),
        "rope_theta": 500000.0,
    },
    "mistral": {"arch": "mistral", "seed": 1},
    # A window shorter than the longer prompts (30 tokens), so it binds.
    "mistral-window": {"arch": "mistral", "seed": 5, "sliding_window": 12},
    "qwen2-bias": {"arch": "qwen2", "seed": 2},
    # Qwen2.5-shaped (0.5B - 3B): q/k/v bias, tied embeddings, rope_theta 1e6.
    "qwen2.5-tied-bias": {"arch": "qwen2", "tie_word_embeddings": True, "seed": 8, "rope_theta": 1000000.0},
    # Qwen3-shaped (0.6B - 4B): q/k norms (random weights, not 1), head_dim 32 != hidden 64 / 4 heads,
    # tied embeddings, no bias.
    "qwen3": {
        "arch": "qwen3",
        "head_dim": 32,
        "tie_word_embeddings": True,
        "seed": 6,
        "rope_theta": 1000000.0,
        "chat_format": "qwen3",  # Hermes turns plus enable_thinking
    },
    # Qwen3 with use_sliding_window on every layer (max_window_layers 0): one window shorter than the
    # longer prompts.
    "qwen3-window": {
        "arch": "qwen3",
        "head_dim": 32,
        "seed": 9,
        "use_sliding_window": True,
        "sliding_window": 12,
        "max_window_layers": 0,
    },
    # Gemma 3: 5 windowed layers (window 8 < the prompts) and a global one, local and global RoPE
    # bases, linear scaling on the global layers, (1 + w) q/k norms, query_pre_attn_scalar, tied.
    "gemma3-window": {
        "arch": "gemma3",
        "seed": 6,
        "num_hidden_layers": 6,
        "head_dim": 32,
        "sliding_window": 8,
        "query_pre_attn_scalar": 24,
        "rope_theta": 10000.0,
        "rope_local_base_freq": 100.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "tie_word_embeddings": True,
    },
    # The text model of Gemma3ForConditionalGeneration (vision tower present in the file, not loaded),
    # with attention_bias (q/k/v and o biased).
    "gemma3-vision": {
        "arch": "gemma3-vision",
        "seed": 7,
        "attention_bias": True,
        "num_hidden_layers": 6,
        "head_dim": 32,
        "sliding_window": 6,
        "query_pre_attn_scalar": 32,
        "tie_word_embeddings": True,
    },
    # Gemma 2: alternating windowed / global layers, attention and final-logit soft-caps small enough
    # to bind (dropping either changes the tokens), tied embeddings.
    "gemma2-softcap": {
        "arch": "gemma2",
        "seed": 8,
        "num_hidden_layers": 4,
        "head_dim": 32,
        "sliding_window": 8,
        "query_pre_attn_scalar": 4,
        "attn_logit_softcapping": 1.5,
        "final_logit_softcapping": 3.0,
        "tie_word_embeddings": True,
    },
    # Phi-3 (Phi3ForCausalLM) checkpoints store qkv_proj / gate_up_proj fused. Phi-4-mini-shaped: partial
    # rotary 0.75 (head 16: 12 rotating dims, 6 frequencies), tied, LongRoPE with an original context of
    # PHI3_ORIGINAL tokens and max_position_embeddings 8x that, so prompts pass it and decodes cross it.
    "phi3-longrope": {
        "arch": "phi3",
        "seed": 8,
        "partial_rotary_factor": 0.75,
        "tie_word_embeddings": True,
        "rope_scaling": {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.3 * i for i in range(6)],
            "long_factor": [3.0 + 2.0 * i for i in range(6)],
        },
        "original_max_position_embeddings": PHI3_ORIGINAL,
        "max_position_embeddings": 8 * PHI3_ORIGINAL,
    },
    "phi3-partial-tied": {
        "arch": "phi3",
        "seed": 7,
        "partial_rotary_factor": 0.75,
        "tie_word_embeddings": True,
    },
    # Phi-3-mini-4k-shaped: every layer slides (its published window is 2047), here shorter than prompts.
    "phi3-window": {"arch": "phi3", "seed": 9, "sliding_window": 12},
}

# One variant per family: each runs on every engine path, with adapters and in deterministic mode.
FAMILIES: tuple[str, ...] = (
    "llama3.2-tied-rope",
    "mistral-window",
    "qwen2.5-tied-bias",
    "qwen3",
    "gemma2-softcap",
    "gemma3-window",
    "phi3-longrope",
)

# Mixture-of-experts families (base_engine/model/moe.py): 8 experts, top-2 / top-4, expert width 32.
_MOE_SHAPE = {"num_hidden_layers": 3, "num_key_value_heads": 2}
CHECKPOINTS.update(
    {
        # Qwen3-MoE: q/k norms, head_dim 32, norm_topk_prob, layer 1 dense (mlp_only_layers).
        "qwen3-moe": {
            "arch": "qwen3_moe",
            "seed": 11,
            **_MOE_SHAPE,
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
        "qwen3-moe-fused": {
            "arch": "qwen3_moe",
            "seed": 12,
            **_MOE_SHAPE,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "expert_layout": "fused",
        },
        # Mixtral: block_sparse_moe w1/w2/w3 names, top-2 renormalised, a window shorter than prompts.
        "mixtral-window": {
            "arch": "mixtral",
            "seed": 13,
            **_MOE_SHAPE,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "sliding_window": 12,
        },
        "mixtral-fused": {
            "arch": "mixtral",
            "seed": 14,
            **_MOE_SHAPE,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "expert_layout": "fused",
        },
        # Qwen2-MoE: q/k/v bias, a gated shared expert, top-4 without renormalisation, sparse step 2.
        "qwen2-moe": {
            "arch": "qwen2_moe",
            "seed": 15,
            **_MOE_SHAPE,
            "num_experts": 8,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "decoder_sparse_step": 2,
        },
    }
)
MOE_FAMILIES: tuple[str, ...] = (
    "qwen3-moe",
    "mixtral-window",
    "qwen2-moe",
    "qwen3-moe-fused",
    "mixtral-fused",
)
