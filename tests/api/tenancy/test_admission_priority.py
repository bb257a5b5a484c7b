"""api.tenancy.admission with priority classes, on the algorithm alone: a flood of less urgent work
leaves `priority_reserve` slots that only the most urgent level seen may take; one level in use uses
the whole capacity as before."""

from __future__ import annotations

import pytest

from api.errors import APIError
from api.tenancy.admission import Admission, Ticket


def _fill(admission: Admission, tenant: str, priority: int) -> list[Ticket]:
    tickets = []
    while True:
        try:
            tickets.append(admission.acquire(1, tenant, priority))
        except APIError as exc:
            assert exc.status == 503 and exc.code == "overloaded"
            return tickets


def test_a_low_priority_flood_leaves_the_reserve_to_urgent_requests() -> None:
    admission = Admission(16, reserve=0, priority_reserve=4)
    assert len(_fill(admission, "batch", priority=5)) == 12  # 16 - 4 kept for priority 0
    with pytest.raises(APIError) as info:
        admission.acquire(1, "batch", 5)
    assert "kept for priority 0" in info.value.message and "priority is 5" in info.value.message
    urgent = [admission.acquire(1, "chat", 0) for _ in range(4)]  # at once, no 503
    assert len(urgent) == 4 and admission.num_in_flight == 16


def test_one_level_in_use_uses_the_whole_capacity() -> None:
    admission = Admission(16, reserve=0, priority_reserve=4)
    assert len(_fill(admission, "a", priority=0)) == 16


def test_the_reserve_follows_the_most_urgent_level_seen() -> None:
    admission = Admission(16, reserve=0, priority_reserve=4)
    admission.acquire(1, "vip", -2).release()
    assert admission.top_priority == -2
    assert len(_fill(admission, "a", priority=0)) == 12  # level 0 is now below the top
    assert admission.acquire(1, "vip", -2) is not None
