"""The fleet's affinity signal, without a Ray cluster: two replicas' apps (real engines, one shared
SQLite registry), each scraped at its own /metrics as Ray's router gets it (`scrape_residency`), and
the ranking Ray's router returns (`rank_by_residency`). An adapter resident on one replica ranks that
replica first; once evicted there and loaded on the other, the other; the base model: no preference.
The parse reads vLLM's series (`vllm:lora_adapter_loaded`, `vllm:num_gpu_loaded_lora_adapters`,
`vllm:max_gpu_lora_adapters`) as llm-d's scorer does (tests/api/metrics/test_residency_metrics.py
checks our exposition against that reader)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from api.fleet.replica import scrape_residency
from api.fleet.residency_signal import (
    CPU_RESIDENT,
    FREE_SLOT,
    GPU_RESIDENT,
    ReplicaResidency,
    parse_residency,
    preference,
    rank_by_residency,
)
from registry.tenants import create_tenant
from tests.harness.replica_apps import ReplicaApp, replica_apps
from tests.harness.uploads import files_of, peft_adapter

pytestmark = pytest.mark.slow


@dataclass
class Fleet:
    loop: asyncio.AbstractEventLoop
    replicas: list[ReplicaApp]

    def run(self, coro):  # noqa: ANN001, ANN201 - any coroutine's result
        return self.loop.run_until_complete(coro)

    def post(self, replica: ReplicaApp, path: str, key: str, **kwargs: object) -> httpx.Response:
        async def go() -> httpx.Response:
            transport = httpx.ASGITransport(replica.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
                headers = {"Authorization": f"Bearer {key}"}
                return await client.post(path, headers=headers, timeout=120, **kwargs)

        return self.run(go())

    def ranking(self, model_id: str) -> list[list[str]]:
        stats = {r.name: self.run(scrape_residency(r.app)) for r in self.replicas}
        residency = {name: ReplicaResidency.from_stats(s) for name, s in stats.items()}
        ranks = rank_by_residency(self.replicas, lambda r: residency[r.name], model_id)
        return [[r.name for r in rank] for rank in ranks]


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet-residency")
    loop = asyncio.new_event_loop()
    try:
        with replica_apps(
            loop, tmp, ("a", "b"),
            model=tiny_llama_dir, served_model_name="tiny-llama", registry=(tmp / "objects").as_uri(),
            admin_key="lsa-fleet-res", num_kv_blocks=64, max_model_len=128, max_loras=2, max_lora_rank=16,
        ) as replicas:  # fmt: skip
            yield Fleet(loop, replicas)
    finally:
        loop.close()


def test_routing_follows_the_adapter_from_one_replica_to_the_other(fleet: Fleet, tmp_path: Path) -> None:
    a, b = fleet.replicas
    with a.state.sessions() as session:
        tenant, key = create_tenant(session, name="residency")
    files = files_of(peft_adapter(tmp_path))
    parts = [("files", (f, c, "application/octet-stream")) for f, c in files.items()]
    assert fleet.post(a, "/v1/adapters", key, data={"name": "bot"}, files=parts).status_code == 201
    model_id = f"{tenant.id}/bot@1"
    assert fleet.ranking(model_id) == [["a", "b"]]  # resident nowhere: both have a free slot
    body = {"model": "bot", "prompt": "hi", "max_tokens": 1}
    assert fleet.post(a, "/v1/completions", key, json=body).status_code == 200  # loads it on a
    assert fleet.ranking(model_id) == [["a"], ["b"]]
    # Evicted on a, loaded on b: routing follows.
    assert fleet.run(a.state.engine.evict_adapters([model_id])) == []  # none still serving
    assert fleet.post(b, "/v1/completions", key, json=body).status_code == 200
    assert fleet.ranking(model_id) == [["b"], ["a"]]
    assert fleet.ranking("") == [["a", "b"]]  # the base model: any replica (Ray's least loaded)


EXPOSITION = """\
# TYPE vllm:lora_adapter_loaded gauge
vllm:lora_adapter_loaded{adapter_name="hot",level="gpu",pinned="false",rank="8"} 1.0
vllm:lora_adapter_loaded{adapter_name="warm",level="cpu",pinned="false",rank="8"} 1.0
vllm:lora_adapter_loaded{adapter_name="gone",level="gpu",pinned="false",rank="8"} 0.0
vllm:lora_adapter_loaded{adapter_name="",level="gpu",pinned="false",rank="8"} 1.0
# TYPE vllm:num_gpu_loaded_lora_adapters gauge
vllm:num_gpu_loaded_lora_adapters{model_name="m"} 1.0
# TYPE vllm:max_gpu_lora_adapters gauge
vllm:max_gpu_lora_adapters{model_name="m"} 1.0
"""


def test_the_parse_reads_the_series_as_the_scorer_does() -> None:
    r = parse_residency(EXPOSITION)
    assert r.loaded == {"hot": "gpu", "warm": "cpu"} and (r.num_gpu_loaded, r.max_gpu) == (1, 1)
    assert ReplicaResidency.from_stats(r.to_stats()) == r and ReplicaResidency.from_stats({}) is None
    # Matched by the name a client sends (or the engine id, with tenant labels on).
    assert preference(r, "t1/hot@3") == GPU_RESIDENT and preference(r, "t1/warm@1") == CPU_RESIDENT
    assert preference(r, "t1/gone@1") == 0  # at 0: absent; and no free GPU slot
    assert preference(ReplicaResidency({}, 0, 2), "t1/x@1") == FREE_SLOT
