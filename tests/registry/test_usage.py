"""Usage records: idempotent writes, summaries against a Python oracle, cursor export, CloudEvents."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy.orm import Session

from registry.usage import (
    BASE_MODEL_KEY,
    UsageGroup,
    UsageRecord,
    export_usage,
    to_cloudevent,
    usage_summary,
    write_usage,
)
from tests.harness.usage import random_records

T0 = datetime(2026, 11, 28, 22, 0, tzinfo=UTC)


def _oracle(records: list[UsageRecord], key) -> list[UsageGroup]:  # type: ignore[no-untyped-def]
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for r in records:
        s = sums[key(r)]
        s[0] += 1
        s[1] += r.prompt_tokens
        s[2] += r.cached_prompt_tokens
        s[3] += r.completion_tokens
    return [UsageGroup(k, *v) for k, v in sorted(sums.items())]


def test_write_is_idempotent_by_request_id(session: Session) -> None:
    records = random_records(20)
    assert write_usage(session, records[:15]) == 15
    assert write_usage(session, records) == 5  # the first 15 are already there
    assert write_usage(session, records) == 0
    assert write_usage(session, []) == 0
    changed = UsageRecord(**{**_asdict(records[0]), "completion_tokens": 10_000})
    assert write_usage(session, [changed, changed]) == 0  # a replay never overwrites the first write
    page = export_usage(session, limit=100)
    assert sorted(r.request_id for r in page.records) == sorted(r.request_id for r in records)
    assert {r.request_id: r for r in page.records} == {r.request_id: r for r in records}  # exact round trip


def _asdict(r: UsageRecord) -> dict[str, object]:
    return {name: getattr(r, name) for name in UsageRecord.__dataclass_fields__}


def test_summaries_match_oracle(session: Session) -> None:
    records = random_records(200)
    write_usage(session, records)
    days = {r.finished_at.strftime("%Y-%m-%d") for r in records}
    assert len(days) == 3
    by_day = usage_summary(session, group_by="day")
    assert by_day == _oracle(records, lambda r: r.finished_at.astimezone(UTC).strftime("%Y-%m-%d"))
    assert usage_summary(session) == by_day  # day is the default
    assert usage_summary(session, group_by="tenant") == _oracle(records, lambda r: r.tenant_id)
    mine = [r for r in records if r.tenant_id == "ta"]
    assert usage_summary(session, tenant_id="ta", group_by="key") == _oracle(
        mine, lambda r: r.key_prefix or ""
    )
    by_adapter = usage_summary(session, tenant_id="ta", group_by="adapter")
    assert by_adapter == _oracle(
        mine, lambda r: f"{r.adapter_name}@{r.adapter_version}" if r.adapter_name else BASE_MODEL_KEY
    )
    start, end = T0 + timedelta(hours=3), T0 + timedelta(hours=20)
    in_range = [r for r in mine if start <= r.finished_at < end]
    assert usage_summary(session, tenant_id="ta", start=start, end=end, group_by="tenant") == _oracle(
        in_range, lambda r: r.tenant_id
    )
    with pytest.raises(ValueError, match="group_by"):
        usage_summary(session, group_by="model")  # type: ignore[arg-type]


def test_days_are_utc_whatever_the_input_zone(session: Session) -> None:
    plus5 = timezone(timedelta(hours=5))
    # 02:00 at +05:00 is 21:00 UTC the day before.
    finished = datetime(2026, 11, 29, 2, 0, tzinfo=plus5)
    record = UsageRecord(**{**_asdict(random_records(1)[0]), "finished_at": finished, "created_at": finished})
    write_usage(session, [record])
    [group] = usage_summary(session, group_by="day")
    assert group.key == "2026-11-28"
    assert export_usage(session).records[0].finished_at == finished  # same instant, returned in UTC


def test_export_by_cursor_covers_each_record_once(session: Session) -> None:
    records = random_records(25)
    write_usage(session, records[:20])
    seen: list[str] = []
    cursor = None
    while True:
        page = export_usage(session, cursor=cursor, limit=7)
        seen += [r.request_id for r in page.records]
        cursor = page.next_cursor
        if not page.has_more:
            break
    assert sorted(seen) == sorted(r.request_id for r in records[:20]) and len(seen) == 20
    write_usage(session, records[20:])  # resumable: later records continue from the cursor
    later = export_usage(session, cursor=cursor, limit=100)
    assert [r.request_id for r in later.records] == [r.request_id for r in records[20:]]
    assert export_usage(session, cursor=later.next_cursor).records == []
    start = T0 + timedelta(hours=10)
    ranged = export_usage(session, start=start, tenant_id="tb", limit=100).records
    assert {r.request_id for r in ranged} == {
        r.request_id for r in records if r.finished_at >= start and r.tenant_id == "tb"
    }
    with pytest.raises(ValueError, match="cursor"):
        export_usage(session, cursor="abc")


def test_cloudevent_uses_request_id() -> None:
    record = random_records(1)[0]
    event = to_cloudevent(record, source="//loraserve/test")
    assert event["specversion"] == "1.0" and event["id"] == record.request_id
    assert event["subject"] == record.tenant_id
    assert event["source"] == f"//loraserve/test/tenants/{record.tenant_id}"
    assert datetime.fromisoformat(event["time"]) == record.finished_at
    assert event["data"]["completion_tokens"] == record.completion_tokens


def test_record_validation() -> None:
    good = _asdict(random_records(1)[0])
    for change, match in [
        ({"request_id": ""}, "request_id"),
        ({"prompt_tokens": -1}, "prompt_tokens"),
        ({"prompt_tokens": 3, "cached_prompt_tokens": 4}, "cached_prompt_tokens"),
        ({"adapter_name": "bot", "adapter_version": None}, "adapter_version"),
        ({"finished_at": datetime(2026, 1, 1)}, "timezone-aware"),
    ]:
        with pytest.raises(ValueError, match=match):
            UsageRecord(**{**good, **change})  # type: ignore[arg-type]
