"""The admin console in a real browser: Debian's Chromium through Playwright against `loraserve serve`.

One Chromium per module, a fresh context (cookie jar) per test, the shared SQLite + LocalStore
server process of tests/harness/shared_server.py. Oracles: the admin and tenant HTTP APIs (what exists, what
a key can do), the usage API for the CSV totals, and the engine's own statistics. When a test
fails, each console page is saved as a PNG in the test's temporary directory.
"""

from __future__ import annotations

import contextlib
import csv
import io
import threading
import time
from collections.abc import Iterator
from datetime import date, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from tests.api.admin.console_helpers import peft_adapter
from tests.harness.servers import Server
from tests.harness.wait import wait_for

playwright_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
PAGES = ("", "/tenants", "/adapters", "/usage")
BASE = "tiny-llama"

# One backend is enough for the browser: the pages read the registry through the same functions.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.parametrize("server", ["sqlite-local"], indirect=True),
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(), reason="needs Debian's chromium (scripts/system_deps.sh)"
    ),
]


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(chromium: Any, server: Server, tmp_path: Path) -> Iterator[Any]:
    context = chromium.new_context(base_url=server.base_url, accept_downloads=True)
    context.set_default_timeout(20_000)
    tab = context.new_page()
    try:
        yield tab
    finally:
        context.close()


@contextlib.contextmanager
def screenshots_on_failure(page: Any, server: Server, out: Path) -> Iterator[None]:
    try:
        yield
    except BaseException:
        for path in PAGES:
            with contextlib.suppress(Exception):
                page.goto(f"{server.base_url}/admin{path}")
                page.screenshot(
                    path=str(out / f"console{path.replace('/', '-') or '-overview'}.png"), full_page=True
                )
        raise


def sign_in(page: Any, key: str) -> None:
    page.goto("/admin")
    page.fill("#admin_key", key)
    page.click("button[type=submit]")


def tenant_can_list_models(server: Server, key: str) -> bool:
    return (
        httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code
        == 200
    )


def complete(server: Server, key: str, model: str, *, max_tokens: int = 6) -> dict[str, Any]:
    body = {"model": model, "prompt": "The console test says", "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                   timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def shown(num: str) -> str:
    """JS: the number a `data-num` element of the Overview shows now."""
    return f"Number(document.querySelector('[data-num=\"{num}\"]').textContent)"


# POST /admin/tenants from the page's own script, with or without the CSRF header.
POST_TENANT_JS = """async ([name, token]) => (await fetch('/admin/tenants', {
    method: 'POST',
    headers: token ? {'X-CSRF-Token': token} : {},
    body: new URLSearchParams({name}),
})).status"""


def test_sign_in_refuses_wrong_and_tenant_keys_then_a_new_tenants_key_is_shown_once(
    page: Any, server: Server, tmp_path: Path
) -> None:
    with screenshots_on_failure(page, server, tmp_path):
        _, tenant_key = server.tenant("console")
        sign_in(page, server.admin_key + "-wrong")
        assert "Incorrect admin key" in page.text_content("#login-error") and "/admin/login" in page.url
        sign_in(page, tenant_key)
        assert "Tenant API keys cannot" in page.text_content("#login-error")
        assert not [c for c in page.context.cookies() if c["name"] == "loraserve_console"]

        sign_in(page, server.admin_key)
        assert page.url == f"{server.base_url}/admin" and page.text_content("h1") == "Overview"
        (cookie,) = [c for c in page.context.cookies() if c["name"] == "loraserve_console"]
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/admin"

        page.click("nav >> text=Tenants")
        name = f"browser-{int(time.time() * 1000) % 10**8}"
        page.fill("#tenant-name", name)
        page.click("#create-tenant button")
        key = page.text_content("#new-api-key").strip()
        assert key.startswith("lsk-") and tenant_can_list_models(server, key)
        page.goto("/admin/tenants")
        listing = page.content()
        assert name in listing and key not in listing


def test_uploaded_adapter_is_listed_with_its_residency(
    page: Any, server: Server, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    with screenshots_on_failure(page, server, tmp_path):
        tenant_id, key = server.tenant("upload")
        tenant_name = server.admin("GET", f"/tenants/{tenant_id}").json()["name"]
        adapter = peft_adapter(tiny_llama_dir, tmp_path / "lora", rank=4)
        files = [
            ("files", (f, (adapter / f).read_bytes()))
            for f in ("adapter_config.json", "adapter_model.safetensors")
        ]
        r = httpx.post(f"{server.base_url}/v1/adapters", data={"name": "helper"}, files=files,
                       headers={"Authorization": f"Bearer {key}"}, timeout=60)  # fmt: skip
        assert r.status_code == 201, r.text

        sign_in(page, server.admin_key)
        page.goto("/admin/adapters")
        row = page.locator(f'tr[data-adapter="helper@1"][data-tenant="{tenant_name}"]')
        assert row.locator("td.residency .badge").first.text_content() in ("disk", "store")
        complete(server, key, "helper")  # loads it into a GPU slot

        def listed_on_gpu() -> bool:
            page.reload()
            return row.locator("td.residency .badge").first.text_content() == "gpu"

        wait_for(listed_on_gpu, 30.0, interval=0.2)
        row.locator("button", has_text="Pin").click()
        assert "helper@1 pinned" in page.text_content(".flash")
        wait_for(lambda: page.reload() or row.locator(".badge.pinned").count() == 1, 30.0, interval=0.2)
        row.locator("button", has_text="Unpin").click()
        assert "helper@1 unpinned" in page.text_content(".flash")


def test_adapter_page_shows_the_coverage_report(
    page: Any, server: Server, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    with screenshots_on_failure(page, server, tmp_path):
        _, key = server.tenant("coverage")
        adapter = peft_adapter(tiny_llama_dir, tmp_path / "lora", rank=4)
        files = [
            ("files", (f, (adapter / f).read_bytes()))
            for f in ("adapter_config.json", "adapter_model.safetensors")
        ]
        r = httpx.post(f"{server.base_url}/v1/adapters", data={"name": "covered"}, files=files,
                       headers={"Authorization": f"Bearer {key}"}, timeout=60)  # fmt: skip
        assert r.status_code == 201, r.text
        coverage = r.json()["coverage"]

        sign_in(page, server.admin_key)
        page.goto("/admin/adapters")
        page.locator('tr[data-adapter="covered@1"] a.adapter-detail').click()
        assert page.text_content("h1").startswith("Adapter covered@1")
        assert page.text_content("#coverage-kinds") == ", ".join(coverage["kinds"]) == "lora"
        rows = page.locator("#coverage-table tbody tr")
        expected = sum(len(modules) for modules in coverage["layers"].values())
        assert rows.count() == expected > 0
        first = rows.first
        layer, module = first.get_attribute("data-layer"), first.get_attribute("data-module")
        shown = float(first.locator("td[data-value]").first.get_attribute("data-value"))
        assert shown == coverage["layers"][layer][module]["delta_fro"]


def test_dashboard_numbers_change_while_requests_run(page: Any, server: Server, tmp_path: Path) -> None:
    with screenshots_on_failure(page, server, tmp_path):
        _, key = server.tenant("dash")
        sign_in(page, server.admin_key)
        before = int(page.text_content('[data-num="goodput.num_requests"]'))
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                complete(server, key, BASE, max_tokens=40)

        threads = [threading.Thread(target=client, daemon=True) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            page.wait_for_function(f"() => {shown('numbers.num_running')} > 0", timeout=30_000)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        page.wait_for_function(f"() => {shown('goodput.num_requests')} > {before}")
        page.wait_for_function("() => document.querySelector('[data-num=\"ttft.p50\"]').textContent !== '–'")
        assert page.locator("svg.chart polyline, svg.chart circle").count() > 0
        first = page.get_attribute("#refreshed", "data-updated-at")
        page.wait_for_function(f"() => document.querySelector('#refreshed').dataset.updatedAt !== '{first}'")


def test_usage_csv_totals_match_the_usage_api(page: Any, server: Server, tmp_path: Path) -> None:
    with screenshots_on_failure(page, server, tmp_path):
        tenant_id, key = server.tenant("bill")
        usages = [complete(server, key, BASE, max_tokens=n)["usage"] for n in (3, 5, 7)]
        sign_in(page, server.admin_key)
        page.goto(f"/admin/usage?tenant_id={tenant_id}")
        totals = page.locator("#usage-totals")
        assert int(totals.get_attribute("data-requests")) == 3
        assert int(totals.get_attribute("data-completion-tokens")) == sum(
            u["completion_tokens"] for u in usages
        )
        with page.expect_download() as download:
            page.click("#csv-tenant")
        console_csv = Path(download.value.path()).read_bytes().decode()
        (row,) = [r for r in csv.DictReader(io.StringIO(console_csv)) if r["key"] == tenant_id]
        tenant_api = httpx.get(f"{server.base_url}/v1/usage", headers={"Authorization": f"Bearer {key}"})
        for field in ("requests", "prompt_tokens", "cached_prompt_tokens", "completion_tokens"):
            assert int(row[field]) == sum(g[field] for g in tenant_api.json()["data"]), field
        assert int(row["prompt_tokens"]) == sum(u["prompt_tokens"] for u in usages)
        # The very same export as the billing API over the same whole days.
        query = parse_qs(urlsplit(page.get_attribute("#csv-tenant", "href")).query)
        start, end = date.fromisoformat(query["start"][0]), date.fromisoformat(query["end"][0])
        params = {"format": "csv", "group_by": "tenant", "tenant_id": tenant_id,
                  "start": start.isoformat(), "end": (end + timedelta(days=1)).isoformat()}  # fmt: skip
        assert console_csv == server.admin("GET", "/usage", params=params).text


def test_state_changes_need_the_csrf_token_and_keys_in_headers_do_not_open_pages(
    page: Any, server: Server, tmp_path: Path
) -> None:
    with screenshots_on_failure(page, server, tmp_path):
        sign_in(page, server.admin_key)
        page.goto("/admin/tenants")
        forged = "no-csrf-" + str(int(time.time() * 1000) % 10**8)
        post = POST_TENANT_JS
        assert page.evaluate(post, [forged, None]) == 403
        page.evaluate("document.querySelector('#create-tenant input[name=csrf_token]').remove()")
        page.fill("#tenant-name", forged)
        with page.expect_response(lambda r: r.request.method == "POST") as response:
            page.click("#create-tenant button")
        assert response.value.status == 403 and "csrf_failed" in page.content()
        names = [t["name"] for t in server.admin("GET", "/tenants").json()["data"]]
        assert forged not in names
        page.goto("/admin/tenants")
        token = page.get_attribute('meta[name="csrf-token"]', "content")
        assert page.evaluate(post, [forged, token]) == 200
        assert forged in [t["name"] for t in server.admin("GET", "/tenants").json()["data"]]

        _, tenant_key = server.tenant("hdr")
        for key in (tenant_key, server.admin_key):
            r = httpx.get(f"{server.base_url}/admin/tenants", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 401
