"""api.tenancy.admission fairness (once, one tenant took all 320 slots while another got 10/10 503s), on the
algorithm alone: a fake clock, tickets taken and released by hand, and a randomized flood."""

from __future__ import annotations

import random

import pytest

from api.errors import APIError
from api.tenancy.admission import WAITING_WINDOW_S, Admission, Ticket


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _try(admission: Admission, tenant: str, num: int = 1) -> Ticket | None:
    try:
        return admission.acquire(num, tenant)
    except APIError as exc:
        assert exc.status == 503 and exc.code == "overloaded" and exc.headers["Retry-After"] == "1"
        return None


def _fill(admission: Admission, tenant: str) -> list[Ticket]:
    tickets = []
    while (ticket := _try(admission, tenant)) is not None:
        tickets.append(ticket)
    return tickets


def test_a_lone_tenant_uses_the_whole_capacity() -> None:
    """Issue 28 item 20: a lone tenant was capped at 280 of 320 slots, told that others were waiting."""
    admission = Admission(320, max_queue_len=256)  # the defaults: 64 running + 256 waiting
    assert admission.reserve == 40
    flood = _fill(admission, "a")
    assert len(flood) == 320  # nobody else waits: the free capacity is its to use
    with pytest.raises(APIError) as info:
        admission.acquire(1, "a")
    assert info.value.message == (
        "The server is overloaded (320 requests in flight, limit 320); retry later."
    )  # what limited it: the server's bound, not others waiting
    victim = [_try(admission, "b") for _ in range(10)]
    assert all(t is not None for t in victim)  # the reserve above the bound: admitted at once


def test_tenant_below_its_share_gets_the_freed_slots() -> None:
    clock = Clock()
    admission = Admission(16, reserve=2, clock=clock)
    a = _fill(admission, "a")
    assert len(a) == 16
    b = _fill(admission, "b")  # the reserve, then refused: b now waits
    assert len(b) == 2 and admission.num_in_flight == 18
    for _ in range(6):
        a.pop().release()
        assert _try(admission, "a") is None  # a is above its share (8) while b waits below it
        b.append(_try(admission, "b"))  # type: ignore[arg-type]
        assert b[-1] is not None
        assert _try(admission, "b") is None  # the bound again: b waits
    assert admission.in_flight_by_tenant() == {"a": 10, "b": 8}
    a.pop().release()
    a.pop().release()
    assert _try(admission, "b") is None  # at its share, and the bound (16) is reached
    with pytest.raises(APIError) as info:
        admission.acquire(1, "a")
    assert "overloaded" in info.value.message  # b holds its share: it is not a waiting tenant
    assert admission.in_flight_by_tenant() == {"a": 8, "b": 8}


def test_over_share_refusal_names_the_waiting_tenants() -> None:
    clock = Clock()
    admission = Admission(16, reserve=0, clock=clock)
    a = _fill(admission, "a")
    assert len(a) == 16 and _try(admission, "b") is None  # b waits
    a.pop().release()
    with pytest.raises(APIError) as info:
        admission.acquire(1, "a")
    assert info.value.message == (
        "The server is busy: this tenant holds 15 of 16 request slots and its fair share is 8 while 1 "
        "other tenant(s) below their share wait; retry later."
    )


def test_three_tenants_converge_to_thirds() -> None:
    clock = Clock()
    admission = Admission(30, reserve=0, clock=clock)
    held: dict[str, list[Ticket]] = {"a": _fill(admission, "a"), "b": [], "c": []}
    rng = random.Random(0)
    for _ in range(2000):  # every tenant keeps asking; requests end at random
        tenant = rng.choice("abc")
        ticket = _try(admission, tenant)
        if ticket is not None:
            held[tenant].append(ticket)
        if rng.random() < 0.5:
            owner = rng.choice([t for t in held if held[t]])
            held[owner].pop(rng.randrange(len(held[owner]))).release()
        clock.now += 0.01
    counts = admission.in_flight_by_tenant()
    assert sum(counts.values()) == admission.num_in_flight <= 30
    assert max(counts.values()) - min(counts.values()) <= 3, counts


def test_unused_share_is_not_wasted() -> None:
    clock = Clock()
    admission = Admission(16, reserve=2, clock=clock)
    b = _try(admission, "b")  # b wants just one request
    a = _fill(admission, "a")
    assert b is not None and len(a) == 15  # a takes every slot but b's (the reserve is above the bound)


def test_waiting_expires() -> None:
    clock = Clock()
    admission = Admission(16, reserve=2, clock=clock)
    a = _fill(admission, "a")
    _fill(admission, "b")  # 2 in the reserve, then b waits
    assert _try(admission, "c") is None  # full, reserve included: c waits
    for _ in range(3):
        a.pop().release()  # a 13 + b 2: below the bound again
    assert _try(admission, "a") is None  # but c is waiting below its share
    clock.now += WAITING_WINDOW_S + 0.1  # c gave up (no retry within the window)
    assert _try(admission, "a") is not None


def test_fairness_off_is_first_come_first_served() -> None:
    admission = Admission(16, fair=False)
    assert len(_fill(admission, "a")) == 16 and _try(admission, "b") is None


def test_multi_request_tickets_count_per_tenant() -> None:
    admission = Admission(8, reserve=0)
    ticket = admission.acquire(3, "a")
    assert admission.in_flight_by_tenant() == {"a": 3}
    ticket.release()
    ticket.release()
    assert admission.in_flight_by_tenant() == {} and admission.num_in_flight == 0
    with pytest.raises(APIError) as info:
        admission.acquire(9, "a")
    assert info.value.status == 400
