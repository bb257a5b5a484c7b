"""Builds a CausalLM and fills it from a Hugging Face checkpoint, packing q/k/v and gate/up (Phi-3
checkpoints store them fused already, in the same q, k, v and gate, up order).

Every parameter must come from the checkpoint with the exact shape; a missing, misshaped or
unexpected tensor is an error naming the tensor and file (never a silently random weight).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch

from base_engine.model.checkpoint import CheckpointReader, MissingTensorError
from base_engine.model.compressed_tensors import read_int8
from base_engine.model.config import ModelConfig
from base_engine.model.decoder import PACKED, CausalLM
from base_engine.model.int8 import Int8Linear
from base_engine.model.moe_weights import moe_tensor

# Tensors some checkpoints carry that the math does not use.
IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")
# A multimodal checkpoint's (Gemma3ForConditionalGeneration) vision tower: not served, not loaded.
VISION = re.compile(r"^(model\.)?(vision_tower|multi_modal_projector)\.")
# Where its text model lives: (prefix of our `model.`, name of our `lm_head.`), transformers 5's
# layout first, then the published checkpoints' (transformers 4.50).
_TEXT_LAYOUTS = (("model.language_model.", "lm_head."), ("language_model.model.", "language_model.lm_head."))

logger = logging.getLogger(__name__)
# model_type -> checkpoints store `qkv_proj` and `gate_up_proj` as one tensor each (transformers' Phi3).
FUSED_CHECKPOINTS = frozenset({"phi3"})


def checkpoint_sources(param_name: str) -> list[str]:
    """Our parameter -> the checkpoint tensors it is made of, in slice order."""
    for packed in ("qkv_proj", "gate_up_proj"):
        if f".{packed}." in param_name:
            parts = [m for m, (p, _) in sorted(PACKED.items(), key=lambda kv: kv[1][1]) if p == packed]
            return [param_name.replace(packed, part) for part in parts]
    return [param_name]


def _text_names(reader: CheckpointReader, config: ModelConfig, model_dir: Path) -> Callable[[str], str]:
    """Our parameter name -> its name in the checkpoint (a multimodal one nests the text model)."""
    if not config.has_vision_tower:
        return lambda name: name
    names = reader.names()
    for body, head in _TEXT_LAYOUTS:
        if any(n.startswith(body) for n in names):

            def rename(name: str, body: str = body, head: str = head) -> str:
                # model.layers.0... -> <body>layers.0...; lm_head.weight -> <head>weight
                return body + name.removeprefix("model.") if name.startswith("model.") else head + name[8:]

            return rename
    raise MissingTensorError(
        f"checkpoint {model_dir} has no text model under {[b for b, _ in _TEXT_LAYOUTS]}; "
        f"{config.architecture} needs one"
    )


def _copy(
    param: torch.nn.Parameter, value: torch.Tensor, sources: list[str], reader: CheckpointReader
) -> None:
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(
            f"tensor {sources[:3]}{' ...' if len(sources) > 3 else ''} in {reader.file_of(sources[0])} has "
            f"shape {tuple(value.shape)}, expected {tuple(param.shape)} from config.json"
        )
    with torch.no_grad():
        param.copy_(value.to(param.device))


def load_model(model_dir: Path, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> CausalLM:
    reader = CheckpointReader(model_dir)
    rename = _text_names(reader, config, model_dir)
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    used: set[str] = set()
    params = dict(model.named_parameters(remove_duplicate=True))
    int8_linears = _int8_linears(model, config, model_dir)
    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, param in params.items():
        expert = moe_tensor(name, config, reader, rename, dtype)
        if expert is not None:
            _copy(param, expert[0], expert[1], reader)
            used.update(expert[1])
            continue
        own = [name] if config.model_type in FUSED_CHECKPOINTS else checkpoint_sources(name)
        sources = [rename(src) for src in own]
        if name.removesuffix(".weight") in int8_linears:
            q, scale, scale_names = read_int8(reader, sources)
            _copy(param, (q.float() * scale[:, None]).to(dtype), sources, reader)  # checks the shape
            quantized[name.removesuffix(".weight")] = (q, scale)
            used.update(sources + scale_names)
            continue
        tensors = []
        for src in sources:
            if src not in reader:
                raise MissingTensorError(
                    f"tensor {src!r} missing from checkpoint {model_dir} (files: {reader.files()}); "
                    f"{config.architecture} with this config.json needs it"
                )
            tensors.append(reader.get(src, dtype=dtype))
            used.add(src)
        _copy(param, torch.cat(tensors, dim=0) if len(tensors) > 1 else tensors[0], sources, reader)
    if config.tie_word_embeddings:
        used.add(rename("lm_head.weight"))
    vision = [n for n in reader.names() if config.has_vision_tower and VISION.match(n)]
    if vision:
        logger.info(
            "%s: serving the text model only; %d vision-tower tensors not loaded (image inputs unsupported)",
            model_dir, len(vision),
        )  # fmt: skip
    unexpected = sorted(
        n for n in reader.names() if n not in used and not IGNORED.search(n) and n not in set(vision)
    )
    if unexpected:
        raise ValueError(
            f"checkpoint {model_dir} has tensors this {config.architecture} does not use: {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''} (does config.json match the weights?)"
        )
    dynamic = config.int8_checkpoint is not None and config.int8_checkpoint.is_dynamic_activations
    for module_name, (q, scale) in quantized.items():
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, child)
        setattr(parent, child, Int8Linear.from_int8(linear, q, scale, is_dynamic_activations=dynamic))
    if quantized:
        logger.info(
            "%s: compressed-tensors int8 checkpoint, %d linear layers %s", model_dir, len(quantized),
            "W8A8 (dynamic per-token activations)" if dynamic else "W8A16 (weight-only)",
        )  # fmt: skip
    return model.eval()


def _int8_linears(model: CausalLM, config: ModelConfig, model_dir: Path) -> set[str]:
    """The linears a compressed-tensors int8 checkpoint stores as int8: every decoder one (none when
    the checkpoint is not one)."""
    if config.int8_checkpoint is None:
        return set()
    if config.moe is not None:
        raise ValueError(
            f"{model_dir}: a compressed-tensors int8 checkpoint of a mixture-of-experts model "
            f"({config.architecture}) is not served; serve its float32/bfloat16 checkpoint"
        )
    return {f"model.{name}" for name, m in model.model.named_modules() if isinstance(m, torch.nn.Linear)}
