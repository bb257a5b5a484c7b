"""Server settings: the one place the environment is read (`LORASERVE_*`, pydantic-settings).

Precedence: CLI options > `LORASERVE_*` environment variables > defaults. Everything below `api`
receives plain values or config dataclasses built here (`engine_config()`), never the environment.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from api.checkpoints.sources import ModelSource, classify
from base_engine.engine_config import EngineConfig


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LORASERVE_", extra="forbid")

    # Where things live.
    # A checkpoint dir, a .gguf file, or a name (api/checkpoints/sources.py): None = SmolLM2-135M-Instruct,
    # "random-demo" = the tiny random-weight demo checkpoint in the data dir (tests).
    model: Path | None = None
    served_model_name: str | None = None  # None = the model's own name (model_source.classify)
    data_dir: Path = Path("loraserve-data")
    models_dir: Path | None = None  # converted GGUF checkpoints, by hash; None = <data_dir>/models
    db: str | None = None  # SQLAlchemy URL; None = SQLite in the data dir
    registry: str | None = None  # file:///dir or s3://bucket/prefix; None = file:// in the data dir
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    admin_key: SecretStr | None = None  # None = generated once and kept in <data_dir>/admin.key
    # vLLM drop-in (api/cli/vllm_flags.py, api/tenancy/static_tenant.py): `--lora-modules` name=path
    # registered at start, and vLLM's `--api-key` (a static key that acts as a key of the tenant).
    lora_modules: list[str] = Field(default_factory=list)
    static_api_key: SecretStr | None = None
    static_tenant: str = "demo"
    chat_template: str | None = None  # vLLM's --chat-template: a file or the template itself
    tool_call_parser: str | None = None  # vLLM's --tool-call-parser: hermes | mistral | llama3_json
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    # Engine (names follow base_engine.EngineConfig / vLLM's engine arguments).
    device: str = "cpu"
    # auto: bfloat16 on a CPU with AMX-BF16 / AVX512-BF16, else float32; the checkpoint's dtype on CUDA.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # int8: per-channel int8 base weights computed at load (CPU); others refused by name (EngineConfig).
    quantization: str | None = None
    max_model_len: int | None = Field(None, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    block_size: int = Field(16, ge=1)
    num_kv_blocks: int | None = Field(None, ge=1)
    kv_cache_gb: float | None = Field(None, gt=0)  # None = a fraction of the free memory (EngineConfig)
    kv_cache_memory_fraction: float | None = Field(None, gt=0, le=1)
    num_threads: int | None = Field(None, ge=1)  # CPU intra-op threads; None = the CPUs we may use
    enable_prefix_caching: bool = True
    max_loras: int = Field(4, ge=1)
    max_cpu_loras: int = Field(16, ge=1)
    # Per adapter: bytes of its modules_to_save matrices (lm_head / embed_tokens) in the serving dtype.
    max_replacement_bytes: int = Field(2 << 30, ge=0)
    # Host tier bytes (adapters/host_tier.py); None = max_cpu_loras plain adapters + one adapter's copies.
    max_cpu_lora_bytes: int | None = Field(None, ge=1)
    max_lora_rank: int = Field(64, ge=1)
    seed: int = 0

    # Serving limits.
    max_queue_len: int = Field(256, ge=0)  # engine requests waiting beyond max_num_seqs; more -> 503
    request_timeout_s: float = Field(600.0, gt=0)
    drain_timeout_s: float = Field(30.0, ge=0)  # SIGTERM grace period before in-flight requests abort
    # Priority classes: a waiting request gains one level per this many seconds (0 = no aging).
    priority_aging_s: float = Field(30.0, ge=0)
    # Any other request body (JSON): larger is 413 before it is read (api/http/body_limit.py).
    max_request_body_bytes: int = Field(8 << 20, ge=1024)
    request_body_timeout_s: float = Field(60.0, gt=0)  # the whole body must arrive within it, else 408
    # A request's headers must arrive within it of the connection opening or the last answer ending
    # (api/http/header_timeout.py: partial headers -> 408, an idle connection is closed).
    request_header_timeout_s: float = Field(20.0, gt=0)
    # Whole multipart body of an adapter upload; None = derived from the base model (the largest legal
    # adapter: seven projections, every layer, max_lora_rank, fp32; api/tenant_adapters/uploads.py
    # `upload_limits`).
    max_upload_bytes: int | None = Field(None, ge=1)
    max_concurrent_uploads: int = Field(4, ge=1)  # received + validated + stored at once; more -> 429
    # ... of which one tenant may hold at most this many (api/tenant_adapters/upload_gate.py); more -> 429
    max_concurrent_uploads_per_tenant: int = Field(2, ge=1)
    # An upload body must arrive within request_body_timeout_s plus its size (Content-Length, else the
    # upload limit) at this rate, else 408: a trickling client cannot hold its slot for long.
    upload_min_bytes_per_s: int = Field(256 << 10, ge=1)
    # Requests of one tenant planned (tokenized) at once in this process; more wait
    # (api/tenancy/plan_gate.py).
    max_concurrent_plans_per_tenant: int = Field(4, ge=1)
    # What one request may ask of the shared engine (api/inference/limits.py); more -> 400 naming the
    # limit. Choices = n x prompts (each one a sequence in the batch); logprob entries per response =
    # choices x max_tokens x (top logprobs + 1); stops per request (OpenAI allows 4 strings).
    max_choices_per_request: int = Field(16, ge=1)
    max_logprob_entries_per_response: int = Field(1 << 18, ge=1)
    max_stop_strings: int = Field(16, ge=0)
    max_stop_string_chars: int = Field(256, ge=1)
    max_stop_token_ids: int = Field(256, ge=0)
    upload_timeout_s: float = Field(120.0, gt=0)  # validate + store + record one upload, else 504
    disk_cache_bytes: int = Field(4 << 30, ge=1)  # local adapter tier (registry.disk_cache.DiskTier)
    # Adapters by reference (api/tenant_adapters/imports.py): URI prefixes (`s3://bucket/prefix`, `file:///dir`)
    # imports may read from; empty = imports refused. file:// prefixes count only with allow_file.
    adapter_import_prefixes: list[str] = Field(default_factory=list)
    adapter_import_allow_file: bool = False

    # Per-tenant rate limits used when a tenant has none of its own (None = unlimited; api/tenancy/quotas.py).
    default_rpm: int | None = Field(None, ge=0)
    default_tpm: int | None = Field(None, ge=0)
    default_max_concurrent: int | None = Field(None, ge=0)
    usage_flush_interval_s: float = Field(1.0, gt=0)  # usage records are written in batches this often
    # Responses API `store: true` (api/inference/stored_responses.py): kept this long, then refused
    # (404 naming it) and purged. OpenAI keeps 30 days.
    response_retention_s: float = Field(30 * 86400.0, gt=0)
    # Unauthenticated /metrics carries no tenant identifiers unless opted in here; a scrape with
    # `Authorization: Bearer <metrics_token>` (or the admin key) gets the per-tenant series anyway.
    metrics_tenant_labels: bool = False
    metrics_token: SecretStr | None = None

    # Slow dependencies: bounded waits, so a hung object store or database ends in an error.
    store_connect_timeout_s: float = Field(3.0, gt=0)  # S3: TCP connect, per attempt
    store_read_timeout_s: float = Field(5.0, gt=0)  # S3: silence on an open connection, per attempt
    store_max_attempts: int = Field(3, ge=1)  # S3: attempts per call (botocore standard retries)
    # A request for an adapter not on local disk waits at most this for its download (queue included),
    # then 503 adapter_unavailable + Retry-After; the download goes on (api/inference/adapter_fetch.py).
    adapter_fetch_wait_s: float = Field(8.0, gt=0)
    # PostgreSQL: the longest a request waits on the database, for a connection or for one call on it
    # (a hung or stopped server included), then 503 database_unavailable (registry/db.py make_engine).
    db_timeout_s: float = Field(5.0, gt=0)
    ready_timeout_s: float = Field(2.0, gt=0)  # /ready: longest wait for one dependency probe
    # Admission fairness: while another tenant below its fair share waits, no tenant takes more than its
    # share of the in-flight slots (api/tenancy/admission.py); a lone tenant may use them all.
    # `admission_reserve` (None = derived) is headroom above `max_in_flight` that only tenants within
    # their share may use, so a newcomer to a server one tenant filled is admitted at once.
    fair_admission: bool = True
    admission_reserve: int | None = Field(None, ge=0)

    # Scale-out: this process is one replica of a fleet. The fleet's state (quotas, console
    # sessions, usage export order, residency) lives in the database; migrations and secrets come from
    # the deploy, never from a replica's start.
    fleet: bool = False
    replica_id: str | None = None  # None = "<hostname>-<pid>" in a fleet
    # Reproducible answers: every request runs batch-invariant, as `deterministic: true` asks.
    deterministic: bool = False
    # Speculative decoding (base_engine/speculative/): "ngram" or None (off); drafts per request and step.
    speculative: str | None = None
    num_speculative_tokens: int = Field(4, ge=1)
    # No drafts in a step with this many decodes: None = measured at start (base_engine/speculative/probe.py),
    # 0 = never switched off.
    speculative_off_batch: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        return self

    @property
    def db_url(self) -> str:
        return self.db or f"sqlite:///{(self.data_dir / 'loraserve.db').resolve()}"

    @property
    def registry_url(self) -> str:
        return self.registry or (self.data_dir / "objects").resolve().as_uri()

    @property
    def model_source(self) -> ModelSource:
        """What `model` names (raises ValueError for a path that is neither a directory nor a .gguf)."""
        return classify(self.model)

    @property
    def is_demo(self) -> bool:
        """Whether the demo tenant and its adapters are set up: the default model or the random demo."""
        return self.model_source.kind in ("default", "random-demo")

    @property
    def is_random_demo(self) -> bool:
        return self.model_source.kind == "random-demo"

    @property
    def demo_model_dir(self) -> Path:
        return self.data_dir / "demo-model"

    @property
    def models_path(self) -> Path:
        return self.models_dir if self.models_dir is not None else self.data_dir / "models"

    @property
    def replica_name(self) -> str:
        """`replica_id`, or "<hostname>-<pid>": unique per process on a host, readable in the console."""
        return self.replica_id or f"{socket.gethostname()}-{os.getpid()}"

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_source.served_name

    @property
    def max_in_flight(self) -> int:
        """Engine requests admitted at once: one full batch plus the bounded waiting queue."""
        return self.max_num_seqs + self.max_queue_len

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            kv_cache_bytes=None if self.kv_cache_gb is None else int(self.kv_cache_gb * (1 << 30)),
            kv_cache_memory_fraction=self.kv_cache_memory_fraction,
            num_threads=self.num_threads,
            enable_prefix_caching=self.enable_prefix_caching,
            seed=self.seed,
            max_loras=self.max_loras,
            max_cpu_loras=self.max_cpu_loras,
            max_replacement_bytes=self.max_replacement_bytes,
            max_cpu_lora_bytes=self.max_cpu_lora_bytes,
            max_lora_rank=self.max_lora_rank,
            deterministic=self.deterministic,  # the engine refuses to start where it cannot keep it
            quantization=self.quantization,
            priority_aging_s=self.priority_aging_s,
            speculative=self.speculative,
            num_speculative_tokens=self.num_speculative_tokens,
            speculative_off_batch=self.speculative_off_batch,
        )


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment with `overrides` (CLI options) on top; None means "not given"."""
    return Settings(**{k: v for k, v in overrides.items() if v is not None})
