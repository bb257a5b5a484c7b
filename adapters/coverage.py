"""What an adapter changes on the served model, computed once at upload (off the request path) and stored
with the version: per (layer, module) rank, scale, kind and the relative size of the delta
`||s B A||_F / ||W||_F`. `||B A||_F^2 = sum((B^T B) * (A A^T))` in float64 (two r x r Gram matrices, no
[out, in] product). An adapter that changes nothing is refused by name: every delta exactly zero (PEFT's
default init saves lora_B = 0) and no DoRA module (a DoRA magnitude can rescale even with zero factors).
No module matched and every target in an excluded layer are refused earlier (peft_targets.py). A delta
below `NEGLIGIBLE` relative everywhere is accepted with a warning. An embedding LoRA is listed as layer -1,
module "embed_tokens", kind "embedding" (its relative delta against the embedding matrix); an lm_head LoRA as
layer -1, module "lm_head", kind "lm_head" (against the served LM head); a modules_to_save copy as layer -1
and its module (a norm under its layer; `model.norm` as "norm"), kind "modules_to_save", rank 0, scale 1,
`delta_fro` = ||copy||_F and no relative delta (it replaces the module rather than adding to it; the base
weights are not at hand at upload)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import torch

from adapters.format import LoraAdapter, LoraPair
from adapters.types import (
    EXPERT_MODULES,
    LORA_MODULES,
    MOE_GATES,
    AdapterValidationError,
    CoverageReport,
    ModuleCoverage,
)

EMBEDDING_LAYER = -1  # the layer index of an embedding LoRA's row (peft_targets.EMBEDDING_TARGET)
NEGLIGIBLE = 1e-6  # relative delta below which an adapter is accepted with a warning


def delta_fro(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    """||scale * b @ a||_F in float64, from the r x r Gram matrices of a [r, in] and b [out, r]."""
    a64, b64 = a.double(), b.double()  # [E, r, in] / [E, out, r] for experts: summed over them
    squared = float(((b64.mT @ b64) * (a64 @ a64.mT)).sum())
    return abs(scale) * math.sqrt(max(squared, 0.0))


def coverage_report(
    adapter: LoraAdapter, weight_norms: Mapping[tuple[int, str], float] | None = None
) -> CoverageReport:
    """The report of a parsed adapter; `weight_norms[(layer, module)] = ||W||_F` of the served model.

    Raises AdapterValidationError when the adapter changes nothing (see the module docstring)."""
    order = {m: i for i, m in enumerate((*LORA_MODULES, *MOE_GATES, *EXPERT_MODULES))}
    items: list[tuple[tuple[int, str], LoraPair]] = sorted(
        [*adapter.weights.items(), *adapter.experts.items()], key=lambda kv: (kv[0][0], order[kv[0][1]])
    )
    if adapter.embedding is not None:
        items.insert(0, ((EMBEDDING_LAYER, "embed_tokens"), adapter.embedding))
    if adapter.lm_head is not None:
        items.append(((EMBEDDING_LAYER, "lm_head"), adapter.lm_head))
    modules = []
    for (layer, module), pair in items:
        fro = delta_fro(pair.a, pair.b, pair.scale)
        norm = None if weight_norms is None else weight_norms.get((layer, module))
        relative = None if not norm else fro / norm
        kind = "dora" if pair.magnitude is not None or pair.out_scale is not None else "lora"
        kind = ("embedding" if module == "embed_tokens" else module) if layer == EMBEDDING_LAYER else kind
        rank = int(pair.a.shape[-2])  # [r, in], or [E, r, in] on experts
        modules.append(ModuleCoverage(layer, module, kind, rank, pair.scale, fro, relative))
    for key, matrix in adapter.replacements.items():
        fro = float(torch.linalg.norm(matrix.double()))
        found = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)  # a layer's norm: (layer, its name)
        layer, module = (int(found.group(1)), found.group(2)) if found else (EMBEDDING_LAYER, key)
        module = module.removeprefix("model.")  # model.norm -> "norm"
        modules.append(ModuleCoverage(layer, module, "modules_to_save", 0, 1.0, fro, None))
    kinds = tuple(
        k
        for k in ("lora", "dora", "embedding", "lm_head", "modules_to_save")
        if any(m.kind == k for m in modules)
    )
    if all(m.delta_fro == 0.0 for m in modules) and "dora" not in kinds and not adapter.replacements:
        raise AdapterValidationError(
            f"the adapter changes nothing: scale * lora_B @ lora_A is zero in all {len(modules)} targeted "
            "modules (an untrained adapter: PEFT initialises lora_B to zeros)"
        )
    warning = None
    relatives = [m.relative_delta for m in modules]
    if relatives and all(r is not None and r < NEGLIGIBLE for r in relatives):
        largest = max(r for r in relatives if r is not None)
        warning = (
            f"negligible change: the largest relative delta ||s B A||_F / ||W||_F is {largest:.3g}, below "
            f"{NEGLIGIBLE:g} in every module"
        )
    return CoverageReport(tuple(modules), kinds, warning)
