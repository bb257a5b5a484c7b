"""Adapter versions: register -> store -> row, resolve, isolation, soft delete, races, failures."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from adapters.types import AdapterSummary
from registry.adapters import (
    delete_adapter,
    get_adapter,
    list_adapters,
    register_adapter_version,
    resolve_adapter,
)
from registry.errors import InvalidAdapter, InvalidName, NotFound, QuotaExceeded, StoreUnavailable
from registry.models import AdapterVersion
from registry.store import ObjectStore, content_key
from registry.stores import open_store
from registry.tenants import create_tenant, set_tenant_status
from registry.types import AdapterVersionInfo, TenantQuotas
from tests.harness.raw_adapters import BASE_MODEL, write_adapter

Validate = Callable[[Path], AdapterSummary]


def _register(
    session: Session, store: ObjectStore, validate: Validate, tenant_id: str, name: str, files: Path
) -> AdapterVersionInfo:
    return register_adapter_version(
        session,
        store,
        tenant_id=tenant_id,
        name=name,
        files_dir=files,
        validate=validate,
        base_model=BASE_MODEL,
    )


def _num_rows(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(AdapterVersion)) or 0)


def test_versions_count_up_and_resolve(
    session: Session, local_store: ObjectStore, validate: Validate, tmp_path: Path
) -> None:
    tenant, _ = create_tenant(session, name="acme")
    infos = [
        _register(session, local_store, validate, tenant.id, "bot", write_adapter(tmp_path / f"v{i}", seed=i))
        for i in range(3)
    ]
    assert [i.version for i in infos] == [1, 2, 3]
    summary = validate(tmp_path / "v1")
    second = infos[1]
    assert second.sha256 == summary.sha256 and second.config_sha256 == summary.config_sha256
    assert second.size_bytes == summary.size_bytes
    assert (second.ranks, second.modules, second.max_rank) == (
        summary.ranks,
        summary.modules,
        summary.max_rank,
    )
    assert second.status == "ready" and second.base_model == BASE_MODEL
    assert second.ref.id == f"{tenant.id}/bot@2" and second.ref.sha256 == summary.sha256
    assert resolve_adapter(session, tenant_id=tenant.id, model="bot") == infos[2]
    assert resolve_adapter(session, tenant_id=tenant.id, model="bot@2") == second
    for info in infos:  # every row's objects are in the store
        assert local_store.exists(content_key(info.sha256)) and local_store.exists(
            content_key(info.config_sha256)
        )
    assert get_adapter(session, tenant_id=tenant.id, name="bot") == infos


def test_names_are_per_tenant_and_not_yours_looks_unknown(
    session: Session, local_store: ObjectStore, validate: Validate, tmp_path: Path
) -> None:
    a, _ = create_tenant(session, name="a")
    b, _ = create_tenant(session, name="b")
    c, _ = create_tenant(session, name="c")
    bot_a = _register(session, local_store, validate, a.id, "bot", write_adapter(tmp_path / "a", seed=1))
    bot_b = _register(session, local_store, validate, b.id, "bot", write_adapter(tmp_path / "b", seed=2))
    assert (bot_a.version, bot_b.version) == (1, 1)  # same name, two tenants, no conflict
    assert resolve_adapter(session, tenant_id=a.id, model="bot").sha256 == bot_a.sha256
    assert resolve_adapter(session, tenant_id=b.id, model="bot").sha256 == bot_b.sha256
    assert [x.tenant_id for x in list_adapters(session, tenant_id=a.id)] == [a.id]
    assert len(list_adapters(session)) == 2

    errors = []
    for call in (
        lambda: resolve_adapter(session, tenant_id=c.id, model="bot"),  # a's and b's, not c's
        lambda: resolve_adapter(session, tenant_id=c.id, model="bot@1"),
        lambda: get_adapter(session, tenant_id=c.id, name="bot"),
        lambda: delete_adapter(session, tenant_id=c.id, name="bot"),
    ):
        with pytest.raises(NotFound) as info:
            call()
        errors.append(str(info.value))
    with pytest.raises(NotFound) as unknown:
        resolve_adapter(session, tenant_id=a.id, model="nope")
    assert errors[0] == errors[2] == errors[3] == "adapter 'bot' not found"
    assert errors[1] == "adapter 'bot@1' not found"
    assert str(unknown.value) == "adapter 'nope' not found"
    assert resolve_adapter(session, tenant_id=a.id, model="bot") == bot_a  # the failed delete touched nothing


@pytest.mark.parametrize("model", ["bot@0", "bot@x", "bot@", "bot@-1", "", "@1"])
def test_malformed_model_is_not_found(session: Session, model: str) -> None:
    tenant, _ = create_tenant(session, name="acme")
    with pytest.raises(NotFound, match="not found"):
        resolve_adapter(session, tenant_id=tenant.id, model=model)


def test_deleted_versions_stop_resolving_and_are_never_reused(
    session: Session, local_store: ObjectStore, validate: Validate, tmp_path: Path
) -> None:
    tenant, _ = create_tenant(session, name="acme")
    for i in range(3):
        _register(session, local_store, validate, tenant.id, "bot", write_adapter(tmp_path / f"v{i}", seed=i))
    [gone] = delete_adapter(session, tenant_id=tenant.id, name="bot", version=3)
    assert gone.status == "deleted" and gone.deleted_at is not None
    with pytest.raises(NotFound):
        resolve_adapter(session, tenant_id=tenant.id, model="bot@3")
    assert resolve_adapter(session, tenant_id=tenant.id, model="bot").version == 2
    assert [d.version for d in delete_adapter(session, tenant_id=tenant.id, name="bot")] == [1, 2]
    with pytest.raises(NotFound, match="adapter 'bot' not found"):
        resolve_adapter(session, tenant_id=tenant.id, model="bot")
    with pytest.raises(NotFound, match="adapter 'bot' not found"):
        delete_adapter(session, tenant_id=tenant.id, name="bot")
    assert list_adapters(session, tenant_id=tenant.id) == []
    assert len(list_adapters(session, tenant_id=tenant.id, include_deleted=True)) == 3
    again = _register(session, local_store, validate, tenant.id, "bot", write_adapter(tmp_path / "v0"))
    assert again.version == 4


def test_rejected_upload_leaves_no_row_and_no_object(
    session: Session, local_store: ObjectStore, validate: Validate, tmp_path: Path
) -> None:
    tenant, _ = create_tenant(session, name="acme")
    with pytest.raises(InvalidAdapter, match="rank"):
        _register(session, local_store, validate, tenant.id, "bot", write_adapter(tmp_path / "big", rank=32))
    no_config = write_adapter(tmp_path / "noconf")
    (no_config / "adapter_config.json").unlink()
    with pytest.raises(InvalidAdapter, match="adapter_config.json"):
        _register(session, local_store, validate, tenant.id, "bot", no_config)
    for bad in ("a/b", "../x", "bot@2", ""):
        with pytest.raises(InvalidName, match="adapter name"):
            _register(session, local_store, validate, tenant.id, bad, write_adapter(tmp_path / "ok"))
    assert _num_rows(session) == 0
    assert list(local_store.list()) == []


def test_store_down_leaves_no_row(
    session: Session,
    s3_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    validate: Validate,
    tmp_path: Path,
) -> None:
    tenant, _ = create_tenant(session, name="acme")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{s.getsockname()[1]}")
    store = open_store("s3://bucket/registry", max_attempts=1)
    with pytest.raises(StoreUnavailable, match="cannot reach S3 endpoint"):
        _register(session, store, validate, tenant.id, "bot", write_adapter(tmp_path / "a"))
    assert _num_rows(session) == 0


def test_concurrent_registrations_of_one_name(
    make_session: Callable[[], Session], local_store: ObjectStore, validate: Validate, tmp_path: Path
) -> None:
    with make_session() as session:
        tenant, _ = create_tenant(session, name="acme")
    num_threads = 4
    dirs = [write_adapter(tmp_path / f"t{i}", seed=i) for i in range(num_threads)]
    barrier = threading.Barrier(num_threads)
    results: dict[int, object] = {}

    def register(i: int) -> None:
        with make_session() as session:
            barrier.wait()
            try:
                results[i] = _register(session, local_store, validate, tenant.id, "bot", dirs[i])
            except Exception as e:  # reported below with the thread's index
                results[i] = e

    threads = [threading.Thread(target=register, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    failures = {i: r for i, r in results.items() if isinstance(r, Exception)}
    assert not failures, failures
    versions = sorted(r.version for r in results.values())  # type: ignore[attr-defined]
    assert versions == list(range(1, num_threads + 1))
    with make_session() as session:
        rows = list_adapters(session, tenant_id=tenant.id)
        assert sorted(r.sha256 for r in rows) == sorted(validate(d).sha256 for d in dirs)
        assert all(local_store.exists(content_key(r.sha256)) for r in rows)
        assert resolve_adapter(session, tenant_id=tenant.id, model="bot").version == num_threads


def test_adapter_quotas(
    session: Session, local_store: ObjectStore, validate: Validate, tmp_path: Path
) -> None:
    one = write_adapter(tmp_path / "one")
    size = validate(one).size_bytes
    tenant, _ = create_tenant(
        session, name="acme", quotas=TenantQuotas(max_adapters=1, max_adapter_bytes=2 * size)
    )
    _register(session, local_store, validate, tenant.id, "bot", one)
    _register(session, local_store, validate, tenant.id, "bot", write_adapter(tmp_path / "two", seed=2))
    with pytest.raises(QuotaExceeded, match="max_adapters exceeded: 2 > 1"):
        _register(session, local_store, validate, tenant.id, "other", one)
    with pytest.raises(QuotaExceeded, match=f"max_adapter_bytes exceeded: {3 * size} > {2 * size}"):
        _register(session, local_store, validate, tenant.id, "bot", write_adapter(tmp_path / "three", seed=3))
    delete_adapter(session, tenant_id=tenant.id, name="bot", version=1)  # frees bytes
    assert _register(session, local_store, validate, tenant.id, "bot", one).version == 3


def test_inactive_tenants_adapters_do_not_resolve(
    session: Session, local_store: ObjectStore, validate: Validate, tmp_path: Path
) -> None:
    tenant, _ = create_tenant(session, name="acme")
    files = write_adapter(tmp_path / "a")
    _register(session, local_store, validate, tenant.id, "bot", files)
    set_tenant_status(session, tenant_id=tenant.id, status="suspended")
    with pytest.raises(NotFound, match="adapter 'bot' not found"):
        resolve_adapter(session, tenant_id=tenant.id, model="bot")
    with pytest.raises(NotFound, match="tenant"):
        _register(session, local_store, validate, tenant.id, "bot", files)
    set_tenant_status(session, tenant_id=tenant.id, status="active")
    assert resolve_adapter(session, tenant_id=tenant.id, model="bot").version == 1
    set_tenant_status(session, tenant_id=tenant.id, status="deleted")
    assert list_adapters(session, tenant_id=tenant.id) == []


def test_registered_version_fetches_through_disk_tier(
    session: Session, store: ObjectStore, validate: Validate, tmp_path: Path
) -> None:
    from registry.disk_cache import DiskTier

    tenant, _ = create_tenant(session, name="acme")
    src = write_adapter(tmp_path / "src")
    info = _register(session, store, validate, tenant.id, "bot", src)
    ref = resolve_adapter(session, tenant_id=tenant.id, model="bot").ref
    path = DiskTier(tmp_path / "tier", store).fetch(ref)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (path / name).read_bytes() == (src / name).read_bytes()
    assert validate(path).sha256 == info.sha256 == ref.sha256
