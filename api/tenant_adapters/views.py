"""The JSON views of adapters shared by the tenant REST API and the admin API, and where each
version lives now (its residency: engine adapter cache, local disk tier or only the object store)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from base_engine.async_engine import AsyncEngine
from registry.disk_cache import DiskTier
from registry.types import AdapterVersionInfo


@dataclass(frozen=True, slots=True)
class Residency:
    """Where a version lives now: "gpu" | "cpu" (engine adapter cache), "disk" (local tier), "store"."""

    engine: AsyncEngine
    disk: DiskTier

    def of(self, info: AdapterVersionInfo) -> str:
        in_engine = self.engine.adapter_residency().get(info.ref_id)
        if in_engine is not None:
            return in_engine
        if f"{info.sha256}-{info.config_sha256}" in self.disk.entries():
            return "disk"
        return "store"


def version_view(info: AdapterVersionInfo, *, residency: Residency) -> dict[str, Any]:
    return {
        "object": "adapter.version",
        "id": f"{info.name}@{info.version}",
        "name": info.name,
        "version": info.version,
        "status": info.status,
        "base_model": info.base_model,
        "sha256": info.sha256,
        "config_sha256": info.config_sha256,
        "rank": info.max_rank,
        "ranks": info.ranks,
        "modules": list(info.modules),
        "coverage": info.coverage,
        "size": info.size_bytes,
        "created_at": int(info.created_at.timestamp()),
        "residency": residency.of(info),
    }


def adapter_views(versions: list[AdapterVersionInfo], *, residency: Residency) -> list[dict[str, Any]]:
    """One entry per (tenant, name), versions oldest first; `latest_version` is what `name` resolves to."""
    grouped: dict[tuple[str, str], list[AdapterVersionInfo]] = {}
    for info in versions:
        grouped.setdefault((info.tenant_id, info.name), []).append(info)
    return [
        {
            "object": "adapter",
            "name": name,
            "latest_version": max(v.version for v in infos),
            "versions": [
                version_view(v, residency=residency) for v in sorted(infos, key=lambda v: v.version)
            ],
        }
        for (_, name), infos in grouped.items()
    ]
