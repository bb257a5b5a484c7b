"""Per-tenant import grants and source claims on both backends: grants replace, a source goes to the
first tenant that claims it, a claim given back frees it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from sqlalchemy.orm import Session

from registry.errors import NotFound
from registry.import_grants import (
    Claim,
    claim_import_source,
    get_import_prefixes,
    is_claimed_by_another,
    release_import_source,
    set_import_prefixes,
)
from registry.tenants import create_tenant

URI = "s3://shared/team/adapter-1"


def test_grants_replace_and_claims_go_to_the_first_tenant(make_session: Callable[[], Session]) -> None:
    with make_session() as s:
        a = create_tenant(s, name="a")[0].id
        b = create_tenant(s, name="b")[0].id
        assert get_import_prefixes(s, tenant_id=a) == []
        assert set_import_prefixes(s, tenant_id=a, prefixes=["s3://x/2", "s3://x/1", "s3://x/2"]) == [
            "s3://x/1",
            "s3://x/2",
        ]
        assert set_import_prefixes(s, tenant_id=a, prefixes=["s3://y"]) == ["s3://y"]
        assert get_import_prefixes(s, tenant_id=a) == ["s3://y"] and get_import_prefixes(s, tenant_id=b) == []
        with pytest.raises(NotFound):
            set_import_prefixes(s, tenant_id="nobody", prefixes=[])

        assert not is_claimed_by_another(s, tenant_id=b, source_uri=URI)
        assert claim_import_source(s, tenant_id=a, source_uri=URI) is Claim.NEW
        assert claim_import_source(s, tenant_id=a, source_uri=URI) is Claim.HELD
        assert claim_import_source(s, tenant_id=b, source_uri=URI) is Claim.TAKEN
        assert is_claimed_by_another(s, tenant_id=b, source_uri=URI)
        assert not is_claimed_by_another(s, tenant_id=a, source_uri=URI)
        release_import_source(s, tenant_id=b, source_uri=URI)  # not b's: nothing happens
        assert claim_import_source(s, tenant_id=b, source_uri=URI) is Claim.TAKEN
        release_import_source(s, tenant_id=a, source_uri=URI)
        assert claim_import_source(s, tenant_id=b, source_uri=URI) is Claim.NEW
