"""Fleet membership end to end: real `loraserve serve --fleet` replicas on one PostgreSQL + moto S3.

Two replicas (`--fleet --replica-id r1|r2`) per module, started together on a database migrated once
beforehand (as a deploy does: `loraserve db upgrade`), each with its own data dir (disk tier).
Admin actions go through r1; the oracles are what r2 (and a third replica started later) report
about their own engines (`GET /admin/api/engine`), how they answer a tenant, and the fleet API.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from migrations.api import upgrade
from tests.harness.postgres import new_database
from tests.harness.s3 import s3_backend
from tests.harness.servers import ADMIN_KEY, Server, ServerProcess, main_server_args
from tests.harness.uploads import files_of, peft_adapter, upload
from tests.harness.wait import wait_for

pytestmark = pytest.mark.slow  # real servers

LOST_AFTER_S = 10.0  # api/fleet/agent.py
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip


class Fleet:
    def __init__(self, args: list[str], env: dict[str, str], tmp: Path, s3: dict[str, str]) -> None:
        self.args, self.env, self.tmp, self.s3 = args, env, tmp, s3
        self.replicas: dict[str, Server] = {}

    def start(self, *replica_ids: str) -> list[Server]:
        """Start replicas concurrently (each start loads the model: minutes of CPU on a busy box)."""
        processes = {
            rid: ServerProcess([*self.args, "--fleet", "--replica-id", rid], self.tmp / rid, env=self.env)
            for rid in replica_ids
        }
        errors: list[BaseException] = []

        def start(process: ServerProcess) -> None:
            try:
                process.start()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(p,)) for p in processes.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        for rid, process in processes.items():
            self.replicas[rid] = Server(process, ADMIN_KEY, "postgres-s3", self.s3)
        return [self.replicas[rid] for rid in replica_ids]


@pytest.fixture(scope="module")
def fleet(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, postgres_url: str, s3_server: str
) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    db_url = new_database(postgres_url)
    upgrade(db_url)  # once per deploy, never by a replica's start
    s3 = s3_backend(s3_server, tmp)
    args = [*main_server_args(tiny_llama_dir), "--db", db_url, "--registry", f"s3://{s3['bucket']}/registry"]
    env = {
        "LORASERVE_ADMIN_KEY": ADMIN_KEY,
        **{k: v for k, v in s3.items() if k.startswith("AWS_")},
    }
    group = Fleet(args, env, tmp, s3)
    group.start("r1", "r2")
    try:
        yield group
        # A clean shutdown (SIGTERM: drain, then the agent leaves) removes the replica's row.
        assert group.replicas["r2"].process.stop() == 0
        assert "r2" not in fleet_rows(group.replicas["r1"])
    finally:
        for server in group.replicas.values():
            if server.process.proc is not None and server.process.proc.poll() is None:
                server.process.stop()


def adapter_cache(server: Server) -> dict[str, Any]:
    """The replica's own engine statistics: `pinned` and `residency` (ref id -> gpu | cpu)."""
    return server.engine_stats()["adapters"]


def new_adapter(server: Server, tmp: Path, name: str, seed: int) -> tuple[str, str, str]:
    """A tenant with one uploaded adapter: (tenant id, tenant key, engine ref id of version 1)."""
    tenant_id, key = server.tenant("fleet")
    r = upload(server, key, name, files_of(peft_adapter(tmp / name, seed=seed)))
    assert r.status_code == 201, r.text
    return tenant_id, key, f"{tenant_id}/{name}@1"


def complete(server: Server, key: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": "fleet", "max_tokens": 2, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=60)


def fleet_rows(server: Server) -> dict[str, dict[str, Any]]:
    r = server.admin("GET", "/fleet")
    assert r.status_code == 200, r.text
    return {row["id"]: row for row in r.json()["data"]}


def test_pin_through_r1_reaches_r2_and_the_fleet_api_shows_both(fleet: Fleet, tmp_path: Path) -> None:
    r1, r2 = fleet.replicas["r1"], fleet.replicas["r2"]
    tenant_id, _, ref_id = new_adapter(r1, tmp_path, "pinned-bot", seed=1)
    assert ref_id not in adapter_cache(r2)["pinned"]
    r = r1.admin("POST", f"/tenants/{tenant_id}/adapters/pinned-bot/pin")
    assert r.status_code == 200, r.text
    wait_for(
        lambda: ref_id in adapter_cache(r2)["pinned"],
        5,
        interval=0.25,
        what="r2 pins what was pinned through r1",
    )
    wait_for(
        lambda: adapter_cache(r2)["residency"].get(ref_id) == "gpu",
        30,
        interval=0.25,
        what="r2 loads it into a slot",
    )

    def both_show_it() -> bool:
        rows = fleet_rows(r2)  # asked of r2: the fleet view is the same through any replica
        held = {rid: {a["id"]: a for a in row["adapters"]} for rid, row in rows.items()}
        return all(held.get(rid, {}).get("pinned-bot@1", {}).get("pinned") for rid in ("r1", "r2"))

    wait_for(both_show_it, 10, what="/admin/api/fleet lists r1 and r2 holding the pinned adapter")
    rows = fleet_rows(r1)
    assert {rows["r1"]["state"], rows["r2"]["state"]} == {"ready"}
    assert ref_id in rows["r2"]["residency"]["pinned"] and rows["r2"]["last_seen"] >= time.time() - 5

    r = r1.admin("POST", f"/tenants/{tenant_id}/adapters/pinned-bot/unpin")
    assert r.status_code == 200, r.text
    wait_for(lambda: ref_id not in adapter_cache(r2)["pinned"], 5, what="r2 unpins it too")


def test_delete_through_r1_is_refused_and_evicted_on_r2(fleet: Fleet, tmp_path: Path) -> None:
    r1, r2 = fleet.replicas["r1"], fleet.replicas["r2"]
    tenant_id, key, ref_id = new_adapter(r1, tmp_path, "doomed", seed=2)
    assert complete(r2, key, "doomed").status_code == 200  # r2 loads it for a request
    wait_for(lambda: ref_id in adapter_cache(r2)["residency"], 10, what="r2 holds the adapter")
    r = r1.admin("DELETE", f"/tenants/{tenant_id}/adapters/doomed")
    assert r.status_code == 200 and r.json()["versions"] == [1], r.text
    refused = complete(r2, key, "doomed")
    assert refused.status_code == 404, refused.text  # the shared registry: refused at once
    wait_for(
        lambda: ref_id not in adapter_cache(r2)["residency"],
        5,
        interval=0.25,
        what="r2 evicts the deleted adapter",
    )
    assert ref_id not in adapter_cache(r1)["residency"]


def test_tenant_delete_and_suspend_reach_every_replica(fleet: Fleet, tmp_path: Path) -> None:
    r1, r2 = fleet.replicas["r1"], fleet.replicas["r2"]
    tenant_id, key, ref_id = new_adapter(r1, tmp_path, "own-delete", seed=3)
    assert complete(r2, key, "own-delete").status_code == 200
    wait_for(lambda: ref_id in adapter_cache(r2)["residency"], 10, what="r2 holds the adapter")
    r = r1.admin("POST", f"/tenants/{tenant_id}/suspend")
    assert r.status_code == 200, r.text
    wait_for(
        lambda: ref_id not in adapter_cache(r2)["residency"],
        5,
        interval=0.25,
        what="r2 drops a suspended tenant's adapter",
    )
    assert complete(r2, key, "own-delete").status_code == 401

    r = r1.admin("POST", f"/tenants/{tenant_id}/activate")
    assert r.status_code == 200 and complete(r2, key, "own-delete").status_code == 200
    wait_for(lambda: ref_id in adapter_cache(r2)["residency"], 10, what="r2 serves it again")
    # The tenant's own DELETE /v1/adapters/{name} through r1 reaches r2 as well.
    gone = httpx.delete(
        f"{r1.base_url}/v1/adapters/own-delete", headers={"Authorization": f"Bearer {key}"}, timeout=30
    )
    assert gone.status_code == 200, gone.text
    wait_for(
        lambda: ref_id not in adapter_cache(r2)["residency"],
        5,
        interval=0.25,
        what="r2 evicts a tenant-deleted adapter",
    )


def test_metrics_carry_the_replica_label(fleet: Fleet) -> None:
    r1 = fleet.replicas["r1"]
    text = httpx.get(f"{r1.base_url}/metrics", timeout=30).text
    assert 'vllm:num_requests_running{engine="0",model_name="tiny-llama",replica="r1"}' in text
    series = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert series and all('replica="r1"' in line for line in series)
    assert httpx.get(f"{r1.base_url}/admin/api/fleet/metrics", timeout=30).status_code == 401

    def merged() -> str | None:
        r = r1.admin("GET", "/fleet/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
        return r.text if 'replica="r1"' in r.text and 'replica="r2"' in r.text else None

    body = wait_for(merged, 10, what="the fleet metrics hold both replicas' series")
    assert body.count("# TYPE vllm:num_requests_running gauge") == 1  # merged, not concatenated
    assert 'loraserve_fleet_replica_up{replica="r2"} 1.0' in body


def test_a_later_replica_applies_pins_and_shows_lost_after_kill_9(fleet: Fleet, tmp_path: Path) -> None:
    r1 = fleet.replicas["r1"]
    tenant_id, _, ref_id = new_adapter(r1, tmp_path, "sticky", seed=4)
    assert r1.admin("POST", f"/tenants/{tenant_id}/adapters/sticky/pin").status_code == 200
    (r3,) = fleet.start("r3")
    wait_for(lambda: ref_id in adapter_cache(r3)["pinned"], 10, what="r3 applies the pin in force")
    assert r1.admin("POST", f"/tenants/{tenant_id}/adapters/sticky/unpin").status_code == 200
    wait_for(
        lambda: fleet_rows(r1).get("r3", {}).get("state") == "ready",
        10,
        interval=0.25,
        what="r3 in the fleet view",
    )

    assert r3.process.proc is not None
    r3.process.proc.send_signal(signal.SIGKILL)
    r3.process.proc.wait(10)
    assert fleet_rows(r1)["r3"]["state"] == "ready"  # not yet: silence takes LOST_AFTER_S to count
    wait_for(lambda: fleet_rows(r1)["r3"]["state"] == "lost", LOST_AFTER_S + 5, what="r3 shown lost")
    assert fleet_rows(r1)["r2"]["state"] == "ready"


def test_console_fleet_page_shows_each_replica_and_what_it_holds(fleet: Fleet, tmp_path: Path) -> None:
    """The Fleet page in a real browser (Debian's Chromium), served by r2, about the whole fleet."""
    playwright = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("needs Debian's chromium (scripts/system_deps.sh)")
    r1, r2 = fleet.replicas["r1"], fleet.replicas["r2"]
    tenant_id, _, ref_id = new_adapter(r1, tmp_path, "shown", seed=5)
    assert r1.admin("POST", f"/tenants/{tenant_id}/adapters/shown/pin").status_code == 200
    wait_for(
        lambda: adapter_cache(r1)["residency"].get(ref_id) == "gpu",
        30,
        interval=0.25,
        what="r1 loads the pinned adapter",
    )
    wait_for(
        lambda: adapter_cache(r2)["residency"].get(ref_id) == "gpu",
        30,
        interval=0.25,
        what="r2 loads the pinned adapter",
    )
    time.sleep(1.5)  # a heartbeat after the loads
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_context(base_url=r2.base_url).new_page()
            page.goto("/admin/fleet")
            page.fill("#admin_key", ADMIN_KEY)
            page.click("button[type=submit]")
            page.wait_for_url("**/admin/fleet")
            for rid in ("r1", "r2"):
                row = page.locator(f'tr[data-replica="{rid}"]')
                assert row.get_attribute("data-state") == "ready"
                held = row.locator('[data-adapter="shown@1"]')
                assert held.get_attribute("data-tier") == "gpu" and "pinned" in held.inner_text()
        finally:
            browser.close()
    assert r1.admin("POST", f"/tenants/{tenant_id}/adapters/shown/unpin").status_code == 200
