"""What produced an answer, kept with its usage record so the answer can be replayed later.

The API builds one `Provenance` per request (api/inference/provenance.py) and sends it in the
`X-Loraserve-Provenance` header; the usage record stores the same fields as one JSON object
(`usage_records.provenance`), and the export hands it out inside each CloudEvent's `data`.
Every field has a default so that a record written by an older or newer server still reads: unknown
keys are dropped, missing ones take their default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class Provenance:
    """The build, the weights, the kernels and the request's own randomness behind one answer."""

    # The server build.
    engine_version: str = UNKNOWN  # loraserve's package version
    git_sha: str = UNKNOWN  # commit of the checkout ("-dirty" when tracked files differ from it)
    torch_version: str = UNKNOWN
    # The weights: the base model, and the adapter (all None = the base model alone).
    base_model: str = UNKNOWN  # the served name
    base_sha256: str = UNKNOWN  # api/inference/provenance.py `base_model_sha256` says what was hashed
    adapter: str | None = None  # the adapter's name (`model` = "<adapter>@<adapter_version>" replays it)
    adapter_version: int | None = None
    adapter_sha256: str | None = None  # adapter_model.safetensors
    adapter_config_sha256: str | None = None  # adapter_config.json (rank, alpha, target modules)
    # How it ran.
    dtype: str = UNKNOWN  # "float32" | "bfloat16" | "float16"
    device: str = UNKNOWN  # "cpu" | "cuda:0"
    device_name: str = UNKNOWN  # GPU name, or CPU model and its SIMD level (kernels differ by both)
    # The engine's kernels; a deterministic request's steps run base_engine/invariant.py's instead.
    lora_kernel: str = UNKNOWN  # "triton" | "torch" (kernels/sgmv)
    attention: str = UNKNOWN  # "paged-triton" | "paged-torch" | "buckets-sdpa"
    # The request.
    seed: int | None = None  # choice 0's seed (sent, or drawn by the server); choice i: (seed + i) mod 2**63
    deterministic: bool = False  # ran batch-invariant: the same tokens whatever shared its batch

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Provenance:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def coerce_provenance(value: Provenance | dict[str, Any] | None) -> Provenance | None:
    """A stored provenance (JSON column, journal line) as the dataclass; None stays None."""
    if value is None or isinstance(value, Provenance):
        return value
    if isinstance(value, dict):
        return Provenance.from_dict(value)
    raise ValueError(f"provenance must be a Provenance or a JSON object, got {type(value).__name__}")
