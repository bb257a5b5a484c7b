"""Load a PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`) onto a base model.

Format: Hugging Face PEFT `save_pretrained` (peft 0.21). Tensors are named
`base_model.model.<module key>.lora_A.weight` ([r, in_features]) and `...lora_B.weight`
([out_features, r]), optionally with the adapter name (`lora_A.default.weight`). PEFT's forward is
`y = W x + scale * B (A x)` for every targeted nn.Linear, whatever `fan_in_fan_out` says: PEFT resets
that flag to False on nn.Linear, and it only ever transposes the *merged* delta, never A or B, so
neither do we. LoRA: Hu et al. 2021, arXiv:2106.09685. Safetensors: huggingface/safetensors format
(8-byte little-endian header length, JSON header, raw little-endian data).

Pickle (`adapter_model.bin`) is never loaded. Anything PEFT would apply differently from
`W x + scale * B A x` on the seven projections is refused with an `AdapterFormatError` naming the
field or tensor (see adapters/README.md).
"""

from __future__ import annotations

import json
import math
import mmap
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from adapters.peft_config import SUPPORTED_MODEL_TYPES, check_fields, parse_spec, resolve_targets
from adapters.types import LORA_MODULES, AdapterFormatError, AdapterValidationError, BaseModelShapes

__all__ = ["AdapterFiles", "AdapterFormatError", "LoraAdapter", "LoraPair", "load_adapter", "parse_adapter"]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PICKLE_NAME = "adapter_model.bin"
_MAX_CONFIG_BYTES = 1 << 20
_MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own header limit
# PEFT configs and safetensors headers nest three or four levels; a deeper document is hostile (near
# the interpreter's recursion limit it breaks json.loads, and later repr() and comparisons of it).
_MAX_JSON_DEPTH = 32
_DTYPES: dict[str, tuple[torch.dtype, int]] = {"F32": (torch.float32, 4), "F16": (torch.float16, 2)}
_DTYPES["BF16"] = (torch.bfloat16, 2)
_PREFIX = "base_model.model."
_LORA_TENSOR = re.compile(r"(?P<module>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight")
_VELORA_TENSOR = re.compile(r"(?P<module>.+)\.lora_velora_embed(?:\.default)?")
# Tensor-name fragments PEFT writes for features we refuse, so the error says which feature it was.
_KNOWN_REFUSED = {
    "lora_magnitude_vector": "DoRA magnitude vector (use_dora)",
    "lora_embedding_": "LoRA on an embedding",
    ".bias": "a LoRA or base bias (lora_bias / bias)",
    "trainable_tokens": "trainable token rows (trainable_token_indices)",
    "base_layer": "a full base-module weight",
    "modules_to_save": "a full module copy (modules_to_save)",
}


@dataclass(frozen=True, slots=True)
class LoraPair:
    """One projection's LoRA factors: delta_W = scale * b @ a."""

    a: torch.Tensor  # [r, in_features]
    b: torch.Tensor  # [out_features, r]
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA, after rank/alpha patterns


@dataclass(frozen=True)
class LoraAdapter:
    """A parsed adapter: factors keyed by (layer index, projection name in LORA_MODULES)."""

    rank_by_module: dict[str, int]  # projection -> rank, max over layers
    max_rank: int
    weights: dict[tuple[int, str], LoraPair]

    @property
    def modules(self) -> tuple[str, ...]:
        """Covered projections, in LORA_MODULES order."""
        return tuple(m for m in LORA_MODULES if m in self.rank_by_module)

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({layer for layer, _ in self.weights}))


@dataclass(frozen=True)
class AdapterFiles:
    """The two files of an adapter directory, read once so hashes and parsing see the same bytes.

    `weights_bytes` is the file's bytes, or with `read_adapter_files(..., mapped=True)` a private
    memory map of it (`mmap.ACCESS_COPY`, never written): hashing and parsing then read the page
    cache and copy nothing; `close()` unmaps it once no tensor views it any more.
    """

    config: dict[str, Any]
    config_bytes: bytes
    weights_bytes: bytes | mmap.mmap

    def close(self) -> None:
        """Unmap mapped weights; if tensors still view them, the map goes when they are collected."""
        if isinstance(self.weights_bytes, mmap.mmap):
            try:
                self.weights_bytes.close()
            except BufferError:
                pass


def read_adapter_files(
    adapter_dir: Path, *, max_size_bytes: int | None = None, mapped: bool = False
) -> AdapterFiles:
    """Read config and weights; the weights' size is checked against `max_size_bytes` before reading.

    `mapped=True` maps the weights instead of reading them (upload validation: no copy of the file
    in memory); the caller closes the result. Only for files nobody truncates while they are mapped.
    """
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise AdapterFormatError(f"adapter directory {str(adapter_dir)!r} does not exist")
    config_path, weights_path = adapter_dir / CONFIG_NAME, adapter_dir / WEIGHTS_NAME
    if not weights_path.is_file():
        if (adapter_dir / PICKLE_NAME).exists():
            raise AdapterFormatError(
                f"the adapter has only {PICKLE_NAME}: pickle files are never loaded; "
                f"re-save with safe_serialization=True to get {WEIGHTS_NAME}"
            )
        raise AdapterFormatError(f"{WEIGHTS_NAME} is missing")  # no path: messages reach tenants
    if not config_path.is_file():
        raise AdapterFormatError(f"{CONFIG_NAME} is missing")
    size = weights_path.stat().st_size
    if max_size_bytes is not None and size > max_size_bytes:
        raise AdapterValidationError(f"{WEIGHTS_NAME} is {size} bytes, above the limit of {max_size_bytes}")
    if config_path.stat().st_size > _MAX_CONFIG_BYTES:
        raise AdapterFormatError(f"{CONFIG_NAME} is larger than {_MAX_CONFIG_BYTES} bytes")
    config_bytes = config_path.read_bytes()
    config = _json_object(config_bytes, CONFIG_NAME)
    with weights_path.open("rb") as f:
        if mapped and size > 0:
            # The map is fixed at `size` (checked above) even if the file grows later.
            return AdapterFiles(config, config_bytes, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY))
        # Bounded read: a file that grew after the stat above still cannot exceed the limit in memory.
        weights = f.read() if max_size_bytes is None else f.read(max_size_bytes + 1)
    if max_size_bytes is not None and len(weights) > max_size_bytes:
        raise AdapterValidationError(
            f"{WEIGHTS_NAME} grew past the limit of {max_size_bytes} bytes while read"
        )
    return AdapterFiles(config, config_bytes, weights)


def _json_depth(value: Any) -> int:
    """Nesting depth of parsed JSON (`{}` is 1), walked without recursion; stops past the limit."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= _MAX_JSON_DEPTH:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def _json_object(data: bytes, what: str) -> dict[str, Any]:
    """`data` as a JSON object nested at most `_MAX_JSON_DEPTH` levels; AdapterFormatError otherwise."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise AdapterFormatError(f"{what} nests deeper than {_MAX_JSON_DEPTH} levels") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterFormatError(f"{what} is not valid JSON: {exc}") from exc
    if _json_depth(value) > _MAX_JSON_DEPTH:
        raise AdapterFormatError(f"{what} nests deeper than {_MAX_JSON_DEPTH} levels")
    if not isinstance(value, dict):
        raise AdapterFormatError(f"{what} must hold a JSON object, got {type(value).__name__}")
    return value


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )


def check_header(data: bytes | mmap.mmap) -> dict[str, tuple[str, list[int]]]:
    """Tensor name -> (dtype, shape) from a safetensors header, refusing truncated or inconsistent files."""
    if len(data) < 8:
        raise AdapterFormatError(f"{WEIGHTS_NAME} is truncated: {len(data)} bytes, no 8-byte header length")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > _MAX_HEADER_BYTES or 8 + header_len > len(data):
        raise AdapterFormatError(
            f"{WEIGHTS_NAME} is truncated or corrupt: header of {header_len} bytes in a {len(data)}-byte file"
        )
    header = _json_object(data[8 : 8 + header_len], f"{WEIGHTS_NAME} header")
    header.pop("__metadata__", None)
    data_len = len(data) - 8 - header_len
    infos: dict[str, tuple[str, list[int]]] = {}
    for name, info in header.items():
        entry = info if isinstance(info, dict) else {}
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not (_is_int_list(shape) and _is_int_list(offsets) and len(offsets) == 2):
            raise AdapterFormatError(f"tensor {name!r} has a malformed header entry {info!r}")
        if dtype not in _DTYPES:
            raise AdapterFormatError(
                f"tensor {name!r} has dtype {dtype!r}; expected one of {sorted(_DTYPES)}"
            )
        begin, end = offsets
        if end - begin != math.prod(shape) * _DTYPES[dtype][1] or end > data_len:
            raise AdapterFormatError(
                f"{WEIGHTS_NAME} is truncated or corrupt: tensor {name!r} {shape} {dtype} needs bytes "
                f"[{begin}, {end}) of a {data_len}-byte data section"
            )
        infos[name] = (dtype, shape)
    return infos


def _mapped_tensors(data: mmap.mmap) -> dict[str, torch.Tensor]:
    """Tensors viewing a mapped safetensors file already passed by `check_header`: no byte is copied.

    Besides `check_header`'s per-tensor checks, the data offsets must tile the data section exactly,
    without gaps or overlaps, as the safetensors library requires of what it loads.
    """
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    header.pop("__metadata__", None)
    data_start, data_len = 8 + header_len, len(data) - 8 - header_len
    position = 0
    for (begin, end), name in sorted((tuple(e["data_offsets"]), n) for n, e in header.items()):
        if begin != position:
            raise ValueError(f"tensor {name!r} starts at byte {begin} of the data section, not {position}")
        position = end
    if position != data_len:
        raise ValueError(f"the tensors cover {position} bytes of a {data_len}-byte data section")
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        dtype, count = _DTYPES[entry["dtype"]][0], math.prod(entry["shape"])
        if count == 0:
            tensors[name] = torch.empty(entry["shape"], dtype=dtype)
        else:
            offset = data_start + entry["data_offsets"][0]
            flat = torch.frombuffer(data, dtype=dtype, count=count, offset=offset)
            tensors[name] = flat.view(entry["shape"])
    return tensors


def _split_tensors(
    tensors: dict[str, torch.Tensor], targets: dict[str, tuple[int, str]], base: BaseModelShapes, velora: bool
) -> dict[str, dict[str, torch.Tensor]]:
    """Module key -> {"A": tensor, "B": tensor}; any tensor not for a targeted projection is refused."""
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        key = name.removeprefix(_PREFIX)
        found = _LORA_TENSOR.fullmatch(key) if name.startswith(_PREFIX) else None
        if found is None:
            if velora and name.startswith(_PREFIX) and _VELORA_TENSOR.fullmatch(key):
                continue  # VeLoRA's buffer only feeds its training-time backward pass
            what = next((why for frag, why in _KNOWN_REFUSED.items() if frag in name), "an unknown tensor")
            raise AdapterFormatError(
                f"tensor {name!r} is {what}; expected only {_PREFIX}<module>.lora_A.weight / .lora_B.weight"
            )
        module = found.group("module")
        if module not in targets:
            layer = re.match(r"model\.layers\.(\d+)\.", module)
            if layer and int(layer.group(1)) >= base.num_layers:
                raise AdapterFormatError(
                    f"tensor {name!r} is for layer {layer.group(1)}, which does not exist: the base model "
                    f"has {base.num_layers} layers"
                )
            raise AdapterFormatError(
                f"tensor {name!r} is for module {module!r}, which adapter_config.json does not target"
            )
        pair = by_module.setdefault(module, {})
        if found.group("which") in pair:
            raise AdapterFormatError(f"tensor {name!r} duplicates lora_{found.group('which')} of {module!r}")
        pair[found.group("which")] = tensor
    return by_module


def _checked_factors(
    key: str, module: str, pair: dict[str, torch.Tensor], r: int, base: BaseModelShapes, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of one targeted module as `dtype`, after checking presence, shapes and finiteness."""
    if "A" not in pair or "B" not in pair:
        missing = [f"{_PREFIX}{key}.lora_{w}.weight" for w in "AB" if w not in pair]
        raise AdapterFormatError(f"adapter_config.json targets {key!r} but tensors {missing} are missing")
    in_features, out_features = base.module_shape(module)
    expected = {"A": (r, in_features), "B": (out_features, r)}  # A [r, in], B [out, r]
    factors = []
    for which in "AB":
        name = f"{_PREFIX}{key}.lora_{which}.weight"
        if tuple(pair[which].shape) != expected[which]:
            raise AdapterFormatError(
                f"tensor {name} has shape {tuple(pair[which].shape)}, expected {expected[which]} "
                f"(r={r}, base {module} in={in_features}, out={out_features})"
            )
        factor = pair[which].to(dtype).contiguous()
        # Checked after the cast, so an fp32 value that overflows the serving dtype is caught too.
        if not bool(torch.isfinite(factor).all()):
            raise AdapterValidationError(f"tensor {name} has non-finite values (checked as {dtype})")
        factors.append(factor)
    return factors[0], factors[1]


def max_activation(dtype: torch.dtype) -> float:
    """The largest hidden-state magnitude the delta bound allows for: 2^16 (far above what real
    checkpoints reach) or sqrt(max) of the serving dtype, whichever is smaller (256 for fp16)."""
    return min(65536.0, math.sqrt(torch.finfo(dtype).max))


def check_delta_bound(key: str, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype) -> None:
    """Refuse factors whose delta can overflow `dtype` for an input with |x_j| <= max_activation.

    With infinity norms (max absolute row sum; submultiplicative, so a bound without forming B @ A):
    shrink |A x| <= ||A|| X and delta |scale B A x| <= |scale| ||B|| ||A|| X must stay <= finfo.max.
    A NaN/Inf lora_alpha (JSON allows both) fails the same check.
    """
    limit = torch.finfo(dtype).max
    x_max = max_activation(dtype)
    norm_a = float(a.double().abs().sum(dim=1).max())  # ||A||_inf, A [r, in]
    norm_b = float(b.double().abs().sum(dim=1).max())  # ||B||_inf, B [out, r]
    if not math.isfinite(scale):
        raise AdapterValidationError(f"{key}: scale {scale} (from lora_alpha / r) is not a finite number")
    shrink, delta = norm_a * x_max, abs(scale) * norm_b * norm_a * x_max
    if not (shrink <= limit and delta <= limit):
        raise AdapterValidationError(
            f"{key}: the LoRA delta can overflow {dtype}: |scale| * ||B||_inf * ||A||_inf * {x_max:g} = "
            f"{delta:.3g} (and ||A||_inf * {x_max:g} = {shrink:.3g}); expected both <= {limit:.3g}"
        )


def parse_adapter(
    files: AdapterFiles,
    *,
    base: BaseModelShapes,
    dtype: torch.dtype = torch.float32,
    max_lora_rank: int | None = None,
) -> LoraAdapter:
    """Check `files` against `base` and return the factors as `dtype` (see module docstring)."""
    if base.model_type not in SUPPORTED_MODEL_TYPES:
        raise AdapterFormatError(
            f"base model_type={base.model_type!r}; expected one of {SUPPORTED_MODEL_TYPES}"
        )
    check_fields(files.config)
    spec = parse_spec(files.config)
    targets = resolve_targets(files.config, base)
    check_header(files.weights_bytes)
    try:
        if isinstance(files.weights_bytes, mmap.mmap):
            tensors = _mapped_tensors(files.weights_bytes)
        else:
            tensors = load_safetensors(files.weights_bytes)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise AdapterFormatError(f"{WEIGHTS_NAME} could not be parsed: {exc}") from exc
    by_module = _split_tensors(tensors, targets, base, spec.has_velora)
    weights: dict[tuple[int, str], LoraPair] = {}
    for key, (layer, module) in targets.items():
        r, scale = spec.rank_and_scale(key)
        if max_lora_rank is not None and r > max_lora_rank:
            raise AdapterValidationError(f"{key} has rank {r}, above max_lora_rank={max_lora_rank}")
        a, b = _checked_factors(key, module, by_module.get(key, {}), r, base, dtype)
        check_delta_bound(key, a, b, scale, dtype)
        weights[(layer, module)] = LoraPair(a=a, b=b, scale=scale)
    ranks: dict[str, int] = {}
    for (_, module), pair in weights.items():
        ranks[module] = max(ranks.get(module, 0), pair.a.shape[0])
    rank_by_module = {m: ranks[m] for m in LORA_MODULES if m in ranks}
    return LoraAdapter(rank_by_module=rank_by_module, max_rank=max(ranks.values()), weights=weights)


def load_adapter(
    adapter_dir: Path,
    *,
    base: BaseModelShapes,
    dtype: torch.dtype = torch.float32,
    max_lora_rank: int | None = None,
) -> LoraAdapter:
    """Read a PEFT LoRA directory on CPU and check it against `base`; raises AdapterFormatError."""
    return parse_adapter(read_adapter_files(adapter_dir), base=base, dtype=dtype, max_lora_rank=max_lora_rank)
