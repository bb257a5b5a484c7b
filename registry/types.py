"""Typed results of the registry's service functions (what crosses into `api`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from adapters.types import AdapterRef
from registry.models import AdapterVersion, ApiKey, AuditEntry, Tenant

# The PEFT file names of an adapter directory (huggingface/peft src/peft/utils/constants.py).
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_HEX = frozenset("0123456789abcdef")


def make_source(config_sha256: str, weights_sha256: str) -> str:
    """`AdapterRef.source` of a registry adapter: the content addresses of its two files."""
    return f"{config_sha256}:{weights_sha256}"


def parse_source(source: str) -> tuple[str, str]:
    """(config_sha256, weights_sha256) of a `make_source` string; ValueError otherwise."""
    parts = source.split(":")
    if len(parts) != 2 or any(len(p) != 64 or not set(p) <= _HEX for p in parts):
        raise ValueError(f"adapter source must be '<config sha256>:<weights sha256>' (hex), got {source!r}")
    return parts[0], parts[1]


# The largest value each quota's column holds (INTEGER, and BIGINT for bytes, on PostgreSQL).
QUOTA_MAX: dict[str, int] = {
    "rpm": 2**31 - 1,
    "tpm": 2**31 - 1,
    "max_concurrent": 2**31 - 1,
    "max_adapters": 2**31 - 1,
    "max_adapter_bytes": 2**63 - 1,
}


@dataclass(frozen=True, slots=True)
class TenantQuotas:
    """Per-tenant limits; None means "the server default" (api/settings.py)."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    max_adapters: int | None = None
    max_adapter_bytes: int | None = None

    def __post_init__(self) -> None:
        for name, maximum in QUOTA_MAX.items():
            value = getattr(self, name)
            if value is not None and not 0 <= value <= maximum:
                raise ValueError(f"quota {name} must be in [0, {maximum}] or None, got {value}")


PRIORITY_MIN, PRIORITY_MAX = -1000, 1000  # the priority levels a tenant or a request may name


@dataclass(frozen=True, slots=True)
class TenantInfo:
    id: str
    name: str
    status: str  # TenantStatus value
    created_at: datetime
    quotas: TenantQuotas = field(default_factory=TenantQuotas)
    default_priority: int = 0  # its requests' default priority and the most urgent they may ask for

    @classmethod
    def from_row(cls, row: Tenant) -> TenantInfo:
        quotas = TenantQuotas(
            rpm=row.rpm,
            tpm=row.tpm,
            max_concurrent=row.max_concurrent,
            max_adapters=row.max_adapters,
            max_adapter_bytes=row.max_adapter_bytes,
        )
        return cls(
            id=row.id,
            name=row.name,
            status=row.status,
            created_at=row.created_at,
            quotas=quotas,
            default_priority=row.default_priority or 0,
        )


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """An API key as the registry remembers it: never the secret."""

    prefix: str
    tenant_id: str
    label: str | None
    created_at: datetime
    revoked_at: datetime | None

    @classmethod
    def from_row(cls, row: ApiKey) -> KeyInfo:
        return cls(
            prefix=row.prefix,
            tenant_id=row.tenant_id,
            label=row.label,
            created_at=row.created_at,
            revoked_at=row.revoked_at,
        )


@dataclass(frozen=True, slots=True)
class AdapterVersionInfo:
    tenant_id: str
    name: str
    version: int
    base_model: str
    status: str  # AdapterStatus value
    sha256: str  # adapter_model.safetensors
    config_sha256: str  # adapter_config.json
    size_bytes: int
    max_rank: int
    ranks: dict[str, int]
    modules: tuple[str, ...]
    created_at: datetime
    deleted_at: datetime | None
    coverage: dict[str, Any] | None = None  # adapters.types.CoverageReport.as_json(), as stored

    @property
    def ref_id(self) -> str:
        """Stable engine-side id, e.g. "3f2a.../support-bot@2"."""
        return f"{self.tenant_id}/{self.name}@{self.version}"

    @property
    def ref(self) -> AdapterRef:
        """What the engine and the disk tier (`registry.disk_cache.DiskTier.fetch`) take."""
        return AdapterRef(
            id=self.ref_id,
            sha256=self.sha256,
            source=make_source(self.config_sha256, self.sha256),
            name=self.name,
        )

    @classmethod
    def from_row(cls, row: AdapterVersion) -> AdapterVersionInfo:
        return cls(
            tenant_id=row.tenant_id,
            name=row.name,
            version=row.version,
            base_model=row.base_model,
            status=row.status,
            sha256=row.sha256,
            config_sha256=row.config_sha256,
            size_bytes=row.size_bytes,
            max_rank=row.max_rank,
            ranks=dict(row.ranks),
            modules=tuple(row.modules),
            coverage=row.coverage,
            created_at=row.created_at,
            deleted_at=row.deleted_at,
        )


@dataclass(frozen=True, slots=True)
class AuditInfo:
    id: int
    created_at: datetime
    actor: str
    action: str
    tenant_id: str | None
    target: str | None
    detail: dict[str, Any] | None

    @classmethod
    def from_row(cls, row: AuditEntry) -> AuditInfo:
        return cls(
            id=row.id,
            created_at=row.created_at,
            actor=row.actor,
            action=row.action,
            tenant_id=row.tenant_id,
            target=row.target,
            detail=row.detail,
        )
