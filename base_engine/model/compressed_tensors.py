"""Pre-quantized checkpoints in the `compressed-tensors` int8 format (as llmcompressor writes them for
vLLM: config.json `quantization_config.quant_method == "compressed-tensors"`, `format "int-quantized"`).

What we serve, exactly as stored: every decoder `Linear` holds `<name>.weight` int8 [out, in] and
`<name>.weight_scale` [out, 1] (symmetric, per output channel, no zero point); the LM head and the
embeddings stay unquantized (`ignore: ["lm_head"]`). Two activation schemes:
- **W8A8, dynamic per-token** (`input_activations: {int, 8 bits, symmetric, strategy "token",
  dynamic true}`), what vLLM's CompressedTensorsW8A8Int8 runs: each row x of the input gets
  s_x = max|x| / 127, x_q = round-half-even(x / s_x) saturated to [-128, 127], an int8 x int8 GEMM
  accumulating in int32 (exact), then y = acc * s_x * s_w (+ bias) in the serving dtype. We compute
  the same formula (base_engine/model/int8.py, `torch._int_mm`); not promised bit-equal to vLLM's
  kernels (their float division / rounding order may differ on ties), only the same quantization.
- **W8A16** (`input_activations: null`): weight-only, as `--quantization int8` computes.

Refused by name: static activation quantization (a calibrated `input_scale`, `dynamic: false`),
asymmetric (zero-point) weights or activations, group / block / tensor weight strategies, other bit
widths and float (FP8) types, other formats (`pack-quantized` int4, `float-quantized`, ...), KV-cache
schemes, sparsity and transforms, and an `ignore` list other than the LM head. Any other
`quant_method` (GPTQ, AWQ, bitsandbytes, ...) is refused as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from base_engine.model.checkpoint import CheckpointReader

METHOD = "compressed-tensors"
_SERVED = (
    "serve the float32/bfloat16 checkpoint (with --quantization int8 for per-channel int8 weights "
    "computed at load) or a compressed-tensors int8 W8A8 / W8A16 checkpoint (per-channel symmetric "
    "weights, dynamic per-token activations)"
)
_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
_ACTIVATIONS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


@dataclass(frozen=True)
class CheckpointInt8:
    """A compressed-tensors int8 checkpoint we serve (every decoder linear int8 per channel)."""

    is_dynamic_activations: bool  # True: W8A8 (int8 per token at run time); False: W8A16


def checkpoint_quantization(raw: dict[str, Any], path: Path) -> CheckpointInt8 | None:
    """config.json's `quantization_config`: None when absent, the served scheme, or a refusal by name."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
    if method != METHOD:
        raise ValueError(
            f"{path}: quantization_config present (quant_method {method!r}); GPTQ, AWQ, bitsandbytes and "
            f"other pre-quantized checkpoints are not served: {_SERVED}"
        )
    return _parse(qc, path)


def _refuse(path: Path, what: str) -> ValueError:
    return ValueError(f"{path}: compressed-tensors checkpoint with {what} is not served; {_SERVED}")


def _parse(qc: dict[str, Any], path: Path) -> CheckpointInt8:
    if qc.get("format") != "int-quantized":
        raise _refuse(path, f"format {qc.get('format')!r} (expected 'int-quantized')")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config", "moe_sparsity_config"):
        if qc.get(key):
            raise _refuse(path, f"{key} {qc[key]!r}")
    if sorted(qc.get("ignore") or []) != ["lm_head"]:
        raise _refuse(path, f"ignore {qc.get('ignore')!r} (expected ['lm_head']: every decoder linear int8)")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse(path, f"{len(groups)} config_groups (expected one scheme for every Linear)")
    (group,) = groups.values()
    if group.get("targets") != ["Linear"]:
        raise _refuse(path, f"targets {group.get('targets')!r} (expected ['Linear'])")
    if group.get("format", "int-quantized") != "int-quantized":
        raise _refuse(path, f"group format {group.get('format')!r} (expected 'int-quantized')")
    if group.get("output_activations") is not None:
        raise _refuse(path, "output activation quantization")
    _check_args(group.get("weights"), _WEIGHTS, "weights", path)
    acts = group.get("input_activations")
    if acts is not None:
        if acts.get("dynamic") is False or acts.get("strategy") == "tensor":
            raise _refuse(
                path,
                "static activation quantization (input_activations dynamic false, a calibrated "
                "input_scale per layer); only dynamic per-token int8 activations (W8A8) are",
            )
        _check_args(acts, _ACTIVATIONS, "input_activations", path)
    return CheckpointInt8(is_dynamic_activations=acts is not None)


def _check_args(args: object, want: dict[str, Any], field: str, path: Path) -> None:
    if not isinstance(args, dict):
        raise _refuse(path, f"{field} {args!r} (expected {want})")
    if args.get("group_size") is not None or args.get("block_structure") is not None:
        raise _refuse(path, f"{field} group_size/block_structure {args.get('group_size')!r}")
    wrong = {k: args.get(k) for k, v in want.items() if args.get(k) != v}
    if wrong:
        raise _refuse(path, f"{field} {wrong} (expected {want})")


def read_int8(reader: CheckpointReader, sources: list[str]) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """The int8 weight [out, in] and float32 scale [out] of one of our (packed) linears, made of the
    checkpoint's `sources` weights in slice order, and the scale tensors' names (read, so used)."""
    qs, scales, names = [], [], []
    for src in sources:
        q = reader.get(src)
        if q.dtype != torch.int8:
            raise ValueError(
                f"tensor {src!r} in {reader.file_of(src)} is {q.dtype}; a compressed-tensors int8 checkpoint "
                "stores every decoder linear weight as int8"
            )
        name = src.removesuffix("weight") + "weight_scale"
        scale = reader.get(name)
        if not scale.is_floating_point() or scale.numel() != q.shape[0]:
            raise ValueError(
                f"tensor {name!r} in {reader.file_of(name)} is {scale.dtype} {tuple(scale.shape)}; "
                f"expected a float scale per output channel ({q.shape[0]}, 1)"
            )
        qs.append(q)
        scales.append(scale.reshape(-1).float())
        names.append(name)
    return torch.cat(qs), torch.cat(scales), names
