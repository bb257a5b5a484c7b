"""Fleet-wide state (issue 16): quota counters, console sessions, usage export ordering."""

from __future__ import annotations

from registry.models import Base

__all__ = ["Base"]
