"""Stored responses (OpenAI's Responses API `store: true`): one row per response a tenant asked to keep.

Keyed by (tenant, response id): a response id made of a client's X-Request-Id is unique only within
its tenant (api/inference/client_id.py). `input_items` is the whole conversation the response
answered (a `previous_response_id` chain's items, then its own input), `response` the response object
as returned; `expires_at` = created + the server's retention, after which it is refused and purged.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, String
from sqlalchemy.orm import Mapped, mapped_column

from registry.models import Base

MAX_RESPONSE_ID_CHARS = 200  # "resp_" + a client's 128-character id, with room


class StoredResponseRow(Base):
    __tablename__ = "stored_responses"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    response_id: Mapped[str] = mapped_column(String(MAX_RESPONSE_ID_CHARS), primary_key=True)
    created_at: Mapped[datetime] = mapped_column()
    expires_at: Mapped[datetime] = mapped_column(index=True)
    input_items: Mapped[list[Any]] = mapped_column(JSON)
    response: Mapped[dict[str, Any]] = mapped_column(JSON)
