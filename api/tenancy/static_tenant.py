"""The tenant of a server started as `vllm serve` is (api/cli/vllm_flags.py): its `--lora-modules`
registered at start, and vLLM's single static `--api-key` acting as one of its keys.

The static key is not stored in the registry: the tenant gets an issued key of its own (kept 0600 in the
data dir, `<tenant>-static-tenant.key`, re-issued if revoked), and `KeyAlias` (api/http/key_alias.py)
rewrites a request's `Authorization: Bearer <static key>` to it, so authentication, quotas and metering
stay those of an issued key.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from adapters.types import AdapterSummary
from api.tenancy.keyfiles import read_secret, replace_secret
from registry.adapters import register_adapter_version
from registry.errors import AuthError, NotFound, RegistryError
from registry.keys import authenticate, issue_key
from registry.store import ObjectStore
from registry.tenants import create_tenant, get_tenant_by_name


class StaticTenantError(Exception):
    """A `--lora-modules` adapter or tenant that cannot be set up: the message names it."""


def parse_lora_module(value: str) -> tuple[str, str]:
    """`name=path` -> (name, path)."""
    name, _, path = value.partition("=")
    if not name or not path:
        raise StaticTenantError(f"--lora-modules {value!r}: expected name=path, both non-empty")
    return name, path


def ensure_static_tenant(
    *,
    sessions: sessionmaker[Session],
    store: ObjectStore,
    data_dir: Path,
    tenant: str,
    lora_modules: list[str],
    validate: Callable[[Path], AdapterSummary],
    base_model: str,
) -> str:
    """The tenant (created when missing) with its `lora_modules` (`name=directory`) registered (an
    identical latest version is kept as it is); returns an issued key of the tenant."""
    with sessions() as session:
        api_key = _tenant_key(session, tenant, data_dir / f"{tenant}-static-tenant.key")
        owner = get_tenant_by_name(session, name=tenant)
        for name, path in map(parse_lora_module, lora_modules):
            directory = Path(path)
            if not directory.is_dir():
                raise StaticTenantError(f"--lora-modules {name}={path}: not a directory")
            try:
                register_adapter_version(
                    session,
                    store,
                    tenant_id=owner.id,
                    name=name,
                    files_dir=directory,
                    validate=validate,
                    base_model=base_model,
                )
            except RegistryError as exc:
                raise StaticTenantError(f"--lora-modules {name}={path}: {exc}") from None
    return api_key


def _tenant_key(session: Session, tenant: str, key_file: Path) -> str:
    saved = read_secret(key_file)
    if saved is not None:
        try:
            if authenticate(session, api_key=saved).name == tenant:
                return saved
        except AuthError:
            pass
    try:
        owner = get_tenant_by_name(session, name=tenant)
        _, api_key = issue_key(session, tenant_id=owner.id, label="static --api-key")
    except NotFound:
        try:
            _, api_key = create_tenant(session, name=tenant, key_label="static --api-key")
        except RegistryError as exc:
            raise StaticTenantError(f"--tenant {tenant}: {exc}") from None
    replace_secret(key_file, api_key)
    return api_key
