"""Which device slot gives way when an adapter needs one and none is empty: the cache's eviction policy.

The cache decides what may be evicted (no in-flight request uses it, the operator has not pinned it)
and owns the tensors; the policy only ranks those candidates. Least recently used first, as in
S-LoRA's unified cache: a slot is "used" when a request takes it and when that request ends.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol


class EvictionPolicy(Protocol):
    def touch(self, slot: int) -> None:
        """`slot` was used now (taken or released by a request)."""

    def victim(self, evictable: Sequence[int]) -> int | None:
        """The slot to empty among `evictable` (occupied, unused, unpinned); None when there is none."""


class LruEviction:
    """The least recently used evictable slot; ties go to the lowest slot index given first."""

    def __init__(self) -> None:
        self._last_used: dict[int, float] = {}  # slot -> time.monotonic() of its last use

    def touch(self, slot: int) -> None:
        self._last_used[slot] = time.monotonic()

    def victim(self, evictable: Sequence[int]) -> int | None:
        if not evictable:
            return None
        return min(evictable, key=lambda slot: self._last_used.get(slot, 0.0))
