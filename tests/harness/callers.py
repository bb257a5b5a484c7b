"""Callers for tests that drive api/ functions in process, without HTTP."""

from __future__ import annotations

from api.context import Caller
from api.state import AppState
from registry.keys import key_prefix
from registry.tenants import create_tenant


def new_caller(state: AppState, name: str) -> Caller:
    """A new tenant as the request path sees its caller."""
    with state.sessions() as session:
        tenant, key = create_tenant(session, name=name)
    return Caller(tenant=tenant, key_prefix=key_prefix(key))
