"""Architectures people bring that the engine does not serve, each with the piece it lacks.

A checkpoint of one of these is refused at load time with its architecture, the missing piece and a
pointer to the model table (`MODEL_TABLE`), never approximated by the nearest family we do serve.
Facts about each family come from its `transformers` config and modeling code.
"""

from __future__ import annotations

# Where the served and refused families are listed, named in every refusal.
MODEL_TABLE = "the model table in base_engine/model/README.md"

_MOE = "a mixture-of-experts MLP (routed experts), which the engine does not implement"

UNSUPPORTED_ARCHITECTURES: dict[str, str] = {
    "Gemma4ForCausalLM": (
        "per-layer input embeddings (hidden_size_per_layer_input), KV caches shared across layers "
        "(num_kv_shared_layers) and its optional mixture-of-experts block"
    ),
    "Gemma4ForConditionalGeneration": (
        "a vision/audio model around a Gemma 4 text decoder, whose per-layer input embeddings and "
        "KV caches shared across layers the engine does not implement"
    ),
    "Gemma3nForCausalLM": "per-layer input embeddings, AltUp and LAuReL blocks (MatFormer)",
    "Gemma3nForConditionalGeneration": "per-layer input embeddings, AltUp and LAuReL blocks (MatFormer)",
    "Qwen3NextForCausalLM": (
        "Gated DeltaNet linear-attention layers (layer_types 'linear_attention'), gated attention "
        "output and " + _MOE
    ),
    "Qwen3_5ForCausalLM": "Gated DeltaNet linear-attention layers (layer_types 'linear_attention')",
    "Qwen3_5ForConditionalGeneration": (
        "Gated DeltaNet linear-attention layers (layer_types 'linear_attention') and a vision tower"
    ),
    "Qwen3_5MoeForCausalLM": "Gated DeltaNet linear-attention layers and " + _MOE,
    "Qwen3_5MoeForConditionalGeneration": "Gated DeltaNet linear-attention layers and " + _MOE,
    "GptOssForCausalLM": (
        "attention sinks (a learned per-head logit in every softmax) and MXFP4-quantized "
        "mixture-of-experts MLPs"
    ),
    "PhimoeForCausalLM": _MOE,
    "OlmoeForCausalLM": _MOE,
    "DeepseekV2ForCausalLM": "multi-head latent attention (MLA) and " + _MOE,
    "DeepseekV3ForCausalLM": "multi-head latent attention (MLA) and " + _MOE,
    "Llama4ForCausalLM": "chunked local attention without RoPE on some layers and " + _MOE,
    "Llama4ForConditionalGeneration": "chunked local attention, a vision tower and " + _MOE,
    "Qwen2VLForConditionalGeneration": "a vision tower and multimodal rotary embeddings (mrope)",
    "Qwen2_5_VLForConditionalGeneration": "a vision tower and multimodal rotary embeddings (mrope)",
    "Qwen3VLForConditionalGeneration": "a vision tower and interleaved multimodal rotary embeddings",
    # Phi relatives that are not Phi3ForCausalLM (which is served).
    "PhiForCausalLM": (
        "Phi-1/1.5/2's parallel attention + MLP block under one LayerNorm (not RMSNorm), a biased GELU "
        "fc1/fc2 MLP and biased projections"
    ),
    "Phi4MultimodalForCausalLM": "vision and audio encoders with their built-in LoRA adapters",
    "Phi3SmallForCausalLM": "block-sparse attention on alternating layers and the gegelu activation",
    "Phi3VForCausalLM": "a CLIP vision tower and image embeddings",
}


def architecture_refusal(architectures: object, supported: list[str]) -> str:
    """Why a config.json `architectures` value cannot be served: the missing piece when it is known."""
    names = architectures if isinstance(architectures, list) else []
    known = [
        f"{name} needs {UNSUPPORTED_ARCHITECTURES[name]}"
        for name in names
        if name in UNSUPPORTED_ARCHITECTURES
    ]
    why = f" ({'; '.join(known)})" if known else ""
    return f"architectures={architectures!r} unsupported{why}; expected one of {supported}, see {MODEL_TABLE}"
