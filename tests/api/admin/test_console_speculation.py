"""The console's Adapters page shows each adapter version's speculative acceptance, in a real browser
(Debian's Chromium through Playwright) against `loraserve serve --speculative ngram`. Oracle: the
server's own `vllm:spec_decode_*` counters for that adapter on /metrics (one tenant uses the name)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.admin.console_helpers import peft_adapter
from tests.harness.engine_inputs import random_prompts
from tests.harness.families import CHECKPOINTS
from tests.harness.servers import Server, bearer, launch_server, main_server_args

playwright_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(), reason="needs Debian's chromium (scripts/system_deps.sh)"
    ),
]


@pytest.fixture(scope="module")
def model_dir(make_checkpoint) -> Path:
    return make_checkpoint(**CHECKPOINTS["llama-tied"])  # repeats itself: drafts get accepted


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = [*main_server_args(model_dir), "--speculative", "ngram", "--num-speculative-tokens", "3"]
    args += ["--speculative-off-batch", "0"]  # a tiny model's measured threshold would switch it off
    with launch_server(args, tmp_path_factory.mktemp("spec-console") / "data") as server:
        yield server


def _metric(text: str, name: str, lora: str) -> float:
    prefix = f"vllm:spec_decode_num_{name}_total{{"
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix) and f'lora_name="{lora}"' in line
    )


def test_adapters_page_shows_acceptance_per_adapter_version(
    server: Server, model_dir: Path, tmp_path: Path
) -> None:
    tenant_id, key = server.tenant("spec-console")
    tenant_name = server.admin("GET", f"/tenants/{tenant_id}").json()["name"]
    adapter = peft_adapter(model_dir, tmp_path / "lora", rank=4)
    files = [
        ("files", (f, (adapter / f).read_bytes()))
        for f in ("adapter_config.json", "adapter_model.safetensors")
    ]
    r = httpx.post(f"{server.base_url}/v1/adapters", data={"name": "drafty"}, files=files,
                   headers=bearer(key), timeout=60)  # fmt: skip
    assert r.status_code == 201, r.text
    r = httpx.post(f"{server.base_url}/v1/adapters", data={"name": "unused"}, files=files,
                   headers=bearer(key), timeout=60)  # fmt: skip
    assert r.status_code == 201, r.text
    for prompt in random_prompts(3, 500, 6, 10, seed=2):
        body = {
            "model": "drafty",
            "prompt": prompt * 3,
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=bearer(key), timeout=120)
        assert r.status_code == 200, r.text
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    drafted = _metric(metrics, "draft_tokens", "drafty")
    assert drafted > 0
    expected = _metric(metrics, "accepted_tokens", "drafty") / drafted

    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page: Any = browser.new_context(base_url=server.base_url).new_page()
            page.goto("/admin")
            page.fill("#admin_key", server.admin_key)
            page.click("button[type=submit]")
            page.goto("/admin/adapters")
            assert "Spec. acceptance" in page.text_content("#adapters-table thead")
            row = page.locator(f'tr[data-adapter="drafty@1"][data-tenant="{tenant_name}"] td.spec-acceptance')
            assert abs(float(row.get_attribute("data-acceptance")) - expected) < 1e-9
            assert row.text_content().strip() == f"{expected * 100:.0f}%"
            unused = page.locator(
                f'tr[data-adapter="unused@1"][data-tenant="{tenant_name}"] td.spec-acceptance'
            )
            assert unused.text_content().strip() == "—" and unused.get_attribute("data-acceptance") is None
        finally:
            browser.close()
