"""Slow upload bodies hold only their own tenant's upload slots, and only until the body's deadline.

Units: the per-tenant gate and the deadline's size scaling. Against a real server: tenant A's clients
trickle their multipart bodies; A gets 429 past its own share, tenant B's uploads still go through,
and A's tricklers are 408 once their deadline passes, which frees their slots."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from api.http.blocking import UploadGate
from api.tenant_adapters.upload_gate import TenantUploadGate, UploadRefusal
from api.tenant_adapters.uploads import UploadLimits
from tests.harness.servers import launch_server, main_server_args
from tests.harness.uploads import (
    answered_within,
    files_of,
    peft_adapter,
    response_status,
    trickling_upload,
    upload,
)

BODY_GRACE_S = 2.0
DECLARED_BYTES = 256 << 10  # at the default 256 KiB/s: one second more than the grace


def test_one_tenant_holds_at_most_its_share_of_the_upload_slots() -> None:
    gate = TenantUploadGate(UploadGate(3), per_tenant=2)
    assert gate.try_enter("a") is None and gate.try_enter("a") is None
    assert gate.try_enter("a") is UploadRefusal.TENANT  # A's share is full; the server is not
    assert gate.try_enter("b") is None
    assert gate.try_enter("c") is UploadRefusal.SERVER
    gate.leave("a")
    assert gate.held_by("a") == 1 and gate.try_enter("c") is None
    for tenant in ("a", "b", "c"):
        gate.leave(tenant)
    assert gate.server.active == 0
    with pytest.raises(RuntimeError):
        gate.leave("a")


def test_body_deadline_scales_with_the_declared_size_up_to_the_limit() -> None:
    limits = UploadLimits(
        body_bytes=10 << 20, weights_bytes=9 << 20, body_grace_s=60, min_bytes_per_s=1 << 20
    )
    assert limits.body_deadline_s(None) == 70  # chunked: the whole limit
    assert limits.body_deadline_s(1 << 20) == 61
    assert limits.body_deadline_s(1 << 30) == 70  # never past the limit's


@pytest.mark.slow
def test_trickling_uploads_of_one_tenant_do_not_refuse_another(tiny_llama_dir: Path, tmp_path: Path) -> None:
    env = {
        "LORASERVE_MAX_CONCURRENT_UPLOADS": "4",
        "LORASERVE_MAX_CONCURRENT_UPLOADS_PER_TENANT": "2",
        "LORASERVE_REQUEST_BODY_TIMEOUT_S": str(BODY_GRACE_S),
    }
    files = files_of(peft_adapter(tmp_path / "adapter"))
    with launch_server(main_server_args(tiny_llama_dir), tmp_path / "data", env=env) as server:
        _, key_a = server.tenant("a")
        _, key_b = server.tenant("b")
        started = time.monotonic()
        tricklers = [
            trickling_upload(server.base_url, key_a, DECLARED_BYTES) for _ in range(4)
        ]  # as many as the server's slots
        try:
            refused = answered_within(tricklers, 1.0)  # past A's share: 429 at once
            assert len(refused) == 2 and [response_status(s) for s in refused] == [429, 429]
            with ThreadPoolExecutor(2) as pool:  # B, at the same time, up to its own share
                answers = list(pool.map(lambda i: upload(server, key_b, f"b{i}", files), range(2)))
            assert [r.status_code for r in answers] == [201, 201], [r.text for r in answers]
            slow = [s for s in tricklers if s not in refused]
            deadline_s = BODY_GRACE_S + DECLARED_BYTES / (256 << 10)
            assert [response_status(s) for s in slow] == [408, 408]
            assert time.monotonic() - started < deadline_s + 2.0
        finally:
            for sock in tricklers:
                sock.close()
        assert upload(server, key_a, "after", files).status_code == 201  # the 408s freed A's slots
