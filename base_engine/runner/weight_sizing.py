"""The model's weights in the memory plan, counted before any is loaded: a model that does not fit the
device is refused with the figures (instead of the host's OOM killer or a CUDA OOM mid-load).

The bytes are the parameters of the engine's own module tree, built on the `meta` device (no memory),
in the serving dtype: every family counts exactly as it is loaded, routed experts included (an MoE model
is mostly experts: Qwen3-30B-A3B holds 128 x 48 layers of them, 29 of its 30.5 B parameters).
kv_sizing.py then sizes the adapter slots and the KV pool from what the weights leave.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from base_engine.model.config import ModelConfig
from base_engine.model.decoder import CausalLM
from base_engine.runner.host import read_host_memory

logger = logging.getLogger(__name__)

GIB = 1 << 30


def _size(num_bytes: int) -> str:
    """1.27 GiB; below a tenth of a GiB in MiB (a tiny model's figures still say something)."""
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB // 10 else f"{num_bytes / (1 << 20):.2f} MiB"


@dataclass(frozen=True, slots=True)
class WeightBytes:
    total: int  # every parameter once (tied embeddings once), in the serving dtype
    experts: int  # of which the routed experts' tensors (0 on a dense model)

    def figures(self, config: ModelConfig, dtype: torch.dtype) -> str:
        text = f"{_size(self.total)} of weights in {str(dtype).removeprefix('torch.')}"
        if config.moe is None:
            return text
        sparse = sum(config.moe.sparse_layers)
        return (
            f"{text}, {_size(self.experts)} of them routed experts ({config.moe.num_experts} experts "
            f"x {sparse} sparse layers)"
        )


def model_weight_bytes(config: ModelConfig, dtype: torch.dtype, *, float32_head: bool = False) -> WeightBytes:
    """The weights of `CausalLM(config)` in `dtype`, counted on the meta device; `float32_head`: plus the
    fp32 copy of the LM head a CPU engine keeps for 16-bit weights (`CausalLM.keep_float32_logits`)."""
    with torch.device("meta"):
        model = CausalLM(config)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    total = experts = 0
    for name, param in model.named_parameters(remove_duplicate=True):
        size = param.numel() * dtype.itemsize
        total += size
        if ".experts." in name:
            experts += size
    if float32_head:
        total += model.lm_head.weight.numel() * torch.float32.itemsize
    return WeightBytes(total=total, experts=experts)


def check_model_fits(config: ModelConfig, dtype: torch.dtype, device: torch.device) -> WeightBytes | None:
    """Before loading: the weights against the free CUDA memory, or the host memory this process may use
    (runner/host.py) on the CPU; the `meta` device holds no data and is not checked."""
    if device.type == "meta":
        return None
    float32_head = device.type == "cpu" and dtype != torch.float32
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        available, where = free, f"free on {device}"
    else:
        available, where = read_host_memory().available_bytes, "of host memory available to this process"
    weights = check_weights_fit(
        config, dtype, available_bytes=available, where=where, float32_head=float32_head
    )
    logger.info("weights: %s (%s %s)", weights.figures(config, dtype), _size(available), where)
    return weights


def check_weights_fit(
    config: ModelConfig, dtype: torch.dtype, *, available_bytes: int, where: str, float32_head: bool = False
) -> WeightBytes:
    """The weights' bytes, or a ValueError naming them and the memory `where` offers."""
    weights = model_weight_bytes(config, dtype, float32_head=float32_head)
    if weights.total > available_bytes:
        raise ValueError(
            f"the model does not fit: {weights.figures(config, dtype)} need more than the "
            f"{_size(available_bytes)} {where}; serve a smaller model or a 16-bit --dtype, "
            "or free memory"
        )
    return weights
