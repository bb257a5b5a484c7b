"""The usage meter's write-ahead journal: JSON lines, appended; compaction replaces the whole file.

`{"op": "begin", request_id, tenant_id, key_prefix, adapter_name, adapter_version, prompt_tokens,
created_at}` when a request is admitted; `{"op": "finish", "record": {UsageRecord fields}}` when it
ends. Times are ISO 8601 with their UTC offset. A line cut short by a crash does not parse and is
skipped by the reader (api/metering.py, `UsageMeter.recover`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from registry.usage import UsageRecord


@dataclass(frozen=True, slots=True)
class InFlightRequest:
    """What is known about a request when it is admitted: enough to bill it as aborted."""

    request_id: str
    tenant_id: str
    key_prefix: str | None
    adapter_name: str | None
    adapter_version: int | None
    prompt_tokens: int
    created_at: datetime

    def aborted(self, finished_at: datetime) -> UsageRecord:
        finished_at = max(finished_at, self.created_at)
        return UsageRecord(
            request_id=self.request_id,
            tenant_id=self.tenant_id,
            key_prefix=self.key_prefix,
            adapter_name=self.adapter_name,
            adapter_version=self.adapter_version,
            prompt_tokens=self.prompt_tokens,
            cached_prompt_tokens=0,
            completion_tokens=0,
            finish_reason="abort",
            queue_time_s=0.0,
            ttft_s=None,
            total_time_s=(finished_at - self.created_at).total_seconds(),
            created_at=self.created_at,
            finished_at=finished_at,
        )


def begin_line(req: InFlightRequest) -> str:
    data = dataclasses.asdict(req)
    data["created_at"] = req.created_at.isoformat()
    return json.dumps({"op": "begin", **data}) + "\n"


def finish_line(record: UsageRecord) -> str:
    data = dataclasses.asdict(record)
    data["created_at"] = record.created_at.isoformat()
    data["finished_at"] = record.finished_at.isoformat()
    return json.dumps({"op": "finish", "record": data}) + "\n"


def parse_line(line: str) -> InFlightRequest | UsageRecord:
    entry: dict[str, Any] = json.loads(line)
    op = entry.pop("op", None)
    if op == "begin":
        entry["created_at"] = datetime.fromisoformat(entry["created_at"])
        return InFlightRequest(**entry)
    if op == "finish":
        data = entry["record"]
        data["created_at"] = datetime.fromisoformat(data["created_at"])
        data["finished_at"] = datetime.fromisoformat(data["finished_at"])
        return UsageRecord(**data)
    raise ValueError(f"journal op must be 'begin' or 'finish', got {op!r}")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
