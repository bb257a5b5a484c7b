"""vLLM's `POST /v1/load_lora_adapter` / `unload_lora_adapter` on a real server: a load is an import by
reference within the tenant's granted prefixes (a path outside them is a 403, nothing registered), the
adapter then serves by its name; an unload deletes it (api/routes/vllm_lora.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.harness.servers import Server, bearer, launch_server, main_server_args
from tests.harness.uploads import peft_adapter

pytestmark = pytest.mark.slow  # a real server


@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    tmp = tmp_path_factory.mktemp("vllm-lora")
    allowed = tmp / "allowed"
    allowed.mkdir()
    env = {
        "LORASERVE_ADAPTER_IMPORT_PREFIXES": json.dumps([f"file://{allowed}"]),
        "LORASERVE_ADAPTER_IMPORT_ALLOW_FILE": "true",
    }
    with launch_server(main_server_args(tiny_llama_dir), tmp / "data", env=env) as server:
        yield server, tmp


def test_load_serve_unload(served) -> None:
    server, tmp = served
    tenant_id, key = server.tenant("vl")
    r = server.admin(
        "PUT", f"/tenants/{tenant_id}/import-prefixes", json={"prefixes": [f"file://{tmp}/allowed"]}
    )
    assert r.status_code == 200, r.text
    adapter = peft_adapter(tmp / "allowed" / "sql")
    outside = peft_adapter(tmp / "outside")

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{server.base_url}/v1/{path}", headers=bearer(key), json=body, timeout=120)

    r = post("load_lora_adapter", {"lora_name": "sql", "lora_path": str(adapter)})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql' added successfully."), r.text
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=120)
    assert "sql" in [m.id for m in client.models.list().data]
    out = client.completions.create(model="sql", prompt="hello", max_tokens=3, temperature=0.0)
    assert out.usage.completion_tokens == 3
    refused = post("load_lora_adapter", {"lora_name": "other", "lora_path": str(outside)})
    assert refused.status_code == 403, refused.text
    assert "other" not in [m.id for m in client.models.list().data]
    r = post("unload_lora_adapter", {"lora_name": "sql"})
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql' removed successfully."), r.text
    assert "sql" not in [m.id for m in client.models.list().data]
    assert post("unload_lora_adapter", {"lora_name": "sql"}).status_code == 404
    assert post("load_lora_adapter", {"lora_name": "x", "lora_path": "/a", "typo": 1}).status_code == 400
