"""Tables of adapters by reference: which sources each tenant may import from, and who imported what.

`import_grants`: the URI prefixes the admin allows one tenant to import from (one row per prefix).
`import_claims`: the first tenant to import from a source owns it; no other tenant's import reads that
source again (api/tenant_adapters/imports.py answers it as a missing object). The key is the sha256 of
the source URI (as `ImportSource.uri` spells it), so URIs up to the 2048 characters an import takes fit
an index on every backend; the URI itself is kept for the admin.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from registry.models import Base, utcnow

MAX_SOURCE_URI_CHARS = 2048


class ImportGrant(Base):
    __tablename__ = "import_grants"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    prefix_sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    prefix: Mapped[str] = mapped_column(String(MAX_SOURCE_URI_CHARS))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ImportClaim(Base):
    __tablename__ = "import_claims"

    source_sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    source_uri: Mapped[str] = mapped_column(String(MAX_SOURCE_URI_CHARS))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
