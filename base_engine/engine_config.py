"""Engine options (one dataclass, validated once); names follow vLLM's engine arguments."""

from __future__ import annotations

from dataclasses import dataclass, fields

# Share of memory the KV pool takes when `kv_cache_memory_fraction` is None: on CUDA of the free device
# memory after the weights and adapter slots; on the CPU of the host memory still available, which the
# weights' page cache, the adapter host tier, the tokenizer and other processes also draw on.
DEFAULT_GPU_KV_FRACTION = 0.9
DEFAULT_CPU_KV_FRACTION = 0.3


QUANTIZATIONS = ("int8",)
# Formats of published quantized checkpoints we do not run: refused by name, pointing at what we serve.
REFUSED_FORMATS = ("gptq", "awq", "bitsandbytes", "bnb", "fp8", "marlin", "exl2", "hqq", "compressed-tensors")


def quantization_refusal(name: str | None) -> str | None:
    """Why `--quantization name` cannot be served, or None (None and "int8" are served)."""
    if name is None or name in QUANTIZATIONS:
        return None
    lowered = str(name).lower()
    what = f"{name!r} checkpoints are not served" if lowered in REFUSED_FORMATS else f"unknown {name!r}"
    return (
        f"quantization {what}; expected one of {list(QUANTIZATIONS)} (per-channel int8 weights computed "
        "at load from a float32/bfloat16 checkpoint) or none; serve the unquantized checkpoint instead"
    )


@dataclass(slots=True)
class EngineConfig:
    max_model_len: int | None = None  # None = the checkpoint's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None  # None = sized from kv_cache_bytes or kv_cache_memory_fraction
    kv_cache_bytes: int | None = None  # the KV pool's size (vLLM's CPU `kv_cache_space`); None = a fraction
    kv_cache_memory_fraction: float | None = None  # None = DEFAULT_GPU_KV_FRACTION / DEFAULT_CPU_KV_FRACTION
    # Intra-op threads on the CPU (torch.set_num_threads at engine start); None = the CPUs this process
    # may use (affinity mask and cgroup quota, runner/host.py).
    num_threads: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    # Multi-LoRA (adapters/): slots on the device, adapters held in host memory, largest rank.
    max_loras: int = 4
    max_lora_rank: int = 64
    max_cpu_loras: int = 16
    # Per adapter: bytes of its modules_to_save matrices (lm_head / embed_tokens) in the serving dtype.
    max_replacement_bytes: int = 2 << 30
    # Host tier bytes (adapters/host_tier.py); None = max_cpu_loras plain adapters + one adapter's copies.
    max_cpu_lora_bytes: int | None = None
    lora_memory_fraction: float = 0.1
    # A waiting request older than this is admitted before younger ones whatever its adapter or tenant.
    max_wait_s: float = 5.0
    # "paged": kernels.attention reads block tables directly (Triton on CUDA, its twin on CPU);
    # "buckets": decodes in length buckets + per-chunk SDPA (fastest on CPU); "auto": paged on CUDA.
    attention: str = "auto"
    # Decode steps replayed from CUDA graphs captured per batch-size bucket (CUDA and paged only).
    enable_cuda_graphs: bool = True
    # Every request batch-invariant (base_engine/invariant.py), as `SamplingParams.deterministic` asks.
    deterministic: bool = False
    # None: weights in the serving dtype; "int8": per-channel int8 base weights (base_engine/model/int8.py).
    quantization: str | None = None
    # A waiting request gains one priority level per this many seconds (base_engine/priority.py); 0 = off.
    priority_aging_s: float = 30.0
    # Speculative decoding (base_engine/speculative/): "ngram", "draft:<dir>" or None (off); drafts per step.
    speculative: str | None = None
    num_speculative_tokens: int = 4
    # No drafts in a step with this many decodes: None = measured at start with the verify cost table that
    # cost-aware k weighs (speculative/probe.py, cost.py); a number (0 = never) = adaptive k alone.
    speculative_off_batch: int | None = None

    def __post_init__(self) -> None:
        positive = ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_loras", "max_lora_rank")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and not 0.0 < fraction <= 1.0:
            raise ValueError(
                f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}"
            )
        if not 0.0 < self.lora_memory_fraction < 1.0:
            raise ValueError(f"lora_memory_fraction must be in (0, 1), got {self.lora_memory_fraction}")
        if (refusal := quantization_refusal(self.quantization)) is not None:
            raise ValueError(refusal)
        if self.attention not in ("auto", "paged", "buckets"):
            raise ValueError(f"attention={self.attention!r}, expected 'auto', 'paged' or 'buckets'")
        # Imported here: api.settings imports this module, and the CLI must start before torch loads.
        from base_engine.speculative.speculator import parse_speculative

        parse_speculative(self.speculative)  # refuses an unknown method by name
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            k = self.num_speculative_tokens
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        off = self.speculative_off_batch
        if off is not None and (not isinstance(off, int) or off < 0):
            raise ValueError(f"speculative_off_batch must be an integer >= 0 or None (measure), got {off!r}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): "
                "every adapter on the device also has its host copy"
            )

    @classmethod
    def from_options(cls, **options: object) -> EngineConfig:
        """Build from keyword options, refusing unknown names (typos must not pass silently)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; expected some of {sorted(known)}")
        return cls(**options)  # type: ignore[arg-type]
