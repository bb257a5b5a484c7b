"""DoRA served as a per-output-feature scale: what PEFT 0.21 computes, precomputed once at load.

DoRA (Liu et al. 2024, arXiv:2402.09353) as `peft.tuners.lora.dora.DoraLinearLayer.forward` runs it:
    norm   = ||W + s * B A||_2 over dim=1 of the [out, in] weight (one norm per output feature, "row")
    result = W x + b + (m / norm - 1) * (W x) + (m / norm) * s * B A x
           = (m / norm) * (W x + s * B A x) + b
The norm is detached (a constant for the backward pass; no effect on inference) and the bias is not
rescaled. So per module the served output is `out_scale * (W x + b + delta) + out_shift` with
`out_scale = m / norm` and `out_shift = (1 - out_scale) * b` (None without a bias): two float32
vectors computed here from the served base weights, which the kernels apply after the LoRA delta.
"""

from __future__ import annotations

import dataclasses

import torch

from adapters.format import LoraAdapter, LoraPair
from adapters.types import AdapterFormatError, AdapterValidationError, BaseWeights

_ROWS_PER_CHUNK = 1024  # bounds the [rows, in] float32 temporary of W + s * B A


def with_dora_scales(adapter: LoraAdapter, base: BaseWeights | None) -> LoraAdapter:
    """`adapter` with out_scale / out_shift on every DoRA module (magnitude dropped); others unchanged."""
    if not any(p.magnitude is not None for p in adapter.weights.values()):
        return adapter
    if base is None:
        raise AdapterFormatError(
            "use_dora needs the base model's weights, which this adapter cache was not given"
        )
    weights: dict[tuple[int, str], LoraPair] = {}
    for (layer, module), pair in adapter.weights.items():
        if pair.magnitude is None:
            weights[(layer, module)] = pair
            continue
        norm = row_norms(base.weight(layer, module), pair.a, pair.b, pair.scale)
        out_scale = pair.magnitude / norm
        if not bool(torch.isfinite(out_scale).all()):
            rows = torch.nonzero(~torch.isfinite(out_scale)).flatten()[:4].tolist()
            raise AdapterValidationError(
                f"layer {layer} {module}: DoRA scale m / ||W + s B A|| is not finite at output features "
                f"{rows} (the weight norm there is {norm[rows].tolist()}); expected a nonzero norm"
            )
        bias = base.bias(layer, module)
        out_shift = None if bias is None else (1.0 - out_scale) * bias.detach().to("cpu", torch.float32)
        weights[(layer, module)] = LoraPair(pair.a, pair.b, pair.scale, None, out_scale, out_shift)
    return dataclasses.replace(adapter, weights=weights)


@torch.no_grad()
def row_norms(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 [out] on the host: ||weight + scale * b @ a||_2 per output feature, computed in float32 on
    the weight's device, `_ROWS_PER_CHUNK` output features at a time."""
    a32 = a.to(weight.device, torch.float32)
    norms = []
    for start in range(0, weight.shape[0], _ROWS_PER_CHUNK):
        rows = slice(start, start + _ROWS_PER_CHUNK)
        merged = weight[rows].to(torch.float32) + scale * (b[rows].to(weight.device, torch.float32) @ a32)
        norms.append(torch.linalg.norm(merged, dim=1))
    return torch.cat(norms).to("cpu")
