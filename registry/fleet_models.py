"""Fleet membership (issue 16): replica heartbeats with their residency, fleet events."""

from __future__ import annotations

from registry.models import Base

__all__ = ["Base"]
