"""The usage meter's write-ahead journal: JSON lines, appended; compaction replaces the whole file.

`{"op": "begin", request_id, tenant_id, key_prefix, adapter_name, adapter_version, prompt_tokens,
created_at, completion_tokens, cached_prompt_tokens, user, provenance}` when a request is admitted
(and, with the progress so far, when compaction rewrites the file); `{"op": "progress", request_id,
completion_tokens, cached_prompt_tokens, tenant_id}` as a stream hands tokens to its client; `{"op": "finish",
"record": {UsageRecord fields}}` when it ends. Times are ISO 8601 with their UTC offset. The reader
does not depend on line order (the largest progress of a request counts, a finish overrides all).
Requests are keyed by (tenant_id, request_id): two tenants may use the same client X-Request-Id; a
progress line written before lines carried tenant_id matches its request id in any tenant.
A line cut short by a crash does not parse and is skipped (api/metering/meter.py, `UsageMeter.recover`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from registry.provenance import Provenance, coerce_provenance
from registry.usage import UsageRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class InFlightRequest:
    """What is known about a request while it runs: enough to bill it as aborted after a crash."""

    request_id: str
    tenant_id: str
    key_prefix: str | None
    adapter_name: str | None
    adapter_version: int | None
    prompt_tokens: int
    created_at: datetime
    completion_tokens: int = 0  # handed to the client so far (streams), over every choice
    cached_prompt_tokens: int = 0  # of the prompt tokens, served from the prefix cache
    user: str | None = None  # the request's OpenAI `user`
    provenance: Provenance | None = None  # what produces the answer (registry/provenance.py)

    @property
    def progress(self) -> Progress:
        return Progress(self.request_id, self.completion_tokens, self.cached_prompt_tokens, self.tenant_id)

    def with_progress(self, progress: Progress) -> InFlightRequest:
        """This request with `progress` applied; counts never go down (lines may come in any order)."""
        return dataclasses.replace(
            self,
            completion_tokens=max(self.completion_tokens, progress.completion_tokens),
            cached_prompt_tokens=min(
                self.prompt_tokens, max(self.cached_prompt_tokens, progress.cached_prompt_tokens)
            ),
        )

    def aborted(self, finished_at: datetime) -> UsageRecord:
        finished_at = max(finished_at, self.created_at)
        return UsageRecord(
            request_id=self.request_id,
            tenant_id=self.tenant_id,
            key_prefix=self.key_prefix,
            adapter_name=self.adapter_name,
            adapter_version=self.adapter_version,
            prompt_tokens=self.prompt_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens,
            completion_tokens=self.completion_tokens,
            finish_reason="abort",
            queue_time_s=0.0,
            ttft_s=None,
            total_time_s=(finished_at - self.created_at).total_seconds(),
            created_at=self.created_at,
            finished_at=finished_at,
            user=self.user,
            provenance=self.provenance,
        )


@dataclass(frozen=True, slots=True)
class Progress:
    """How far a running request got: what its client has been sent."""

    request_id: str
    completion_tokens: int
    cached_prompt_tokens: int
    tenant_id: str | None = None  # None: a line from before lines carried it (any tenant's request)


def begin_line(req: InFlightRequest) -> str:
    data = dataclasses.asdict(req)
    data["created_at"] = req.created_at.isoformat()
    return json.dumps({"op": "begin", **data}) + "\n"


def progress_line(req: InFlightRequest) -> str:
    return json.dumps({"op": "progress", **dataclasses.asdict(req.progress)}) + "\n"


def finish_line(record: UsageRecord) -> str:
    data = dataclasses.asdict(record)
    data["created_at"] = record.created_at.isoformat()
    data["finished_at"] = record.finished_at.isoformat()
    return json.dumps({"op": "finish", "record": data}) + "\n"


def parse_line(line: str) -> InFlightRequest | Progress | UsageRecord:
    entry: dict[str, Any] = json.loads(line)
    op = entry.pop("op", None)
    if op == "begin":
        entry["created_at"] = datetime.fromisoformat(entry["created_at"])
        entry["provenance"] = coerce_provenance(entry.get("provenance"))
        return InFlightRequest(**entry)
    if op == "progress":
        return Progress(**entry)
    if op == "finish":
        data = entry["record"]
        data["created_at"] = datetime.fromisoformat(data["created_at"])
        data["finished_at"] = datetime.fromisoformat(data["finished_at"])
        return UsageRecord(**data)
    raise ValueError(f"journal op must be 'begin', 'progress' or 'finish', got {op!r}")


def replay(paths: list[Path], crashed_at: datetime) -> tuple[list[UsageRecord], int]:
    """What a crashed run's journal files (read in order) still owe: every finished record, and every
    begun request without one, billed as aborted at `crashed_at` with its largest progress. Returns
    (records, how many of them were unfinished)."""
    begun: dict[tuple[str, str], InFlightRequest] = {}
    progress: list[Progress] = []
    finished: dict[tuple[str, str], UsageRecord] = {}
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            try:
                entry = parse_line(line)
            except (ValueError, KeyError, TypeError) as exc:  # a torn last line after a crash
                logger.warning("skipping unreadable usage journal line %d of %s: %s", number, path, exc)
                continue
            if isinstance(entry, InFlightRequest):
                key = (entry.tenant_id, entry.request_id)
                known = begun.get(key)
                begun[key] = entry if known is None else known.with_progress(entry.progress)
            elif isinstance(entry, Progress):
                progress.append(entry)
            else:
                finished.setdefault((entry.tenant_id, entry.request_id), entry)
    for step in progress:  # lines come in any order: a progress line may precede its begin line
        for key in [k for k in begun if k[1] == step.request_id and step.tenant_id in (None, k[0])]:
            begun[key] = begun[key].with_progress(step)
    unfinished = [req.aborted(crashed_at) for key, req in begun.items() if key not in finished]
    return [*finished.values(), *unfinished], len(unfinished)


def open_journal(path: Path, *, truncate: bool = False) -> IO[str]:
    """The journal (or its compacted successor) for appending, created and kept 0600."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if truncate else 0)
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)  # also a journal left by a version that created it 0644
    return os.fdopen(fd, "a", encoding="utf-8")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
