"""Builds a CausalLM and fills it from a Hugging Face checkpoint, packing q/k/v and gate/up (Phi-3
checkpoints store them fused already, in the same q, k, v and gate, up order).

Every parameter must come from the checkpoint with the exact shape; a missing, misshaped or
unexpected tensor is an error naming the tensor and file (never a silently random weight).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from base_engine.model.checkpoint import CheckpointReader, MissingTensorError
from base_engine.model.config import ModelConfig
from base_engine.model.decoder import PACKED, CausalLM

# Tensors some checkpoints carry that the math does not use.
IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")
# model_type -> checkpoints store `qkv_proj` and `gate_up_proj` as one tensor each (transformers' Phi3).
FUSED_CHECKPOINTS = frozenset({"phi3"})


def checkpoint_sources(param_name: str) -> list[str]:
    """Our parameter -> the checkpoint tensors it is made of, in slice order."""
    for packed in ("qkv_proj", "gate_up_proj"):
        if f".{packed}." in param_name:
            parts = [m for m, (p, _) in sorted(PACKED.items(), key=lambda kv: kv[1][1]) if p == packed]
            return [param_name.replace(packed, part) for part in parts]
    return [param_name]


def load_model(model_dir: Path, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> CausalLM:
    reader = CheckpointReader(model_dir)
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    used: set[str] = set()
    params = dict(model.named_parameters(remove_duplicate=True))
    for name, param in params.items():
        sources = [name] if config.model_type in FUSED_CHECKPOINTS else checkpoint_sources(name)
        tensors = []
        for src in sources:
            if src not in reader:
                raise MissingTensorError(
                    f"tensor {src!r} missing from checkpoint {model_dir} (files: {reader.files()}); "
                    f"{config.architecture} with this config.json needs it"
                )
            tensors.append(reader.get(src, dtype=dtype))
            used.add(src)
        value = torch.cat(tensors, dim=0) if len(tensors) > 1 else tensors[0]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"tensor {sources} in {reader.file_of(sources[0])} has shape {tuple(value.shape)}, "
                f"expected {tuple(param.shape)} from config.json"
            )
        with torch.no_grad():
            param.copy_(value.to(device))
    if config.tie_word_embeddings:
        used.add("lm_head.weight")
    unexpected = sorted(n for n in reader.names() if n not in used and not IGNORED.search(n))
    if unexpected:
        raise ValueError(
            f"checkpoint {model_dir} has tensors this {config.architecture} does not use: {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''} (does config.json match the weights?)"
        )
    return model.eval()
