"""RELIABILITY.md from the rows the cases emitted: a table, the outage detail, and the JSON lines (which a
`--cases` re-run reads back to keep the rows it did not re-run)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from reliability.common import ROWS


def _previous_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of an earlier RELIABILITY.md (kept for the cases a `--cases` run leaves out)."""
    if not path.exists():
        return []
    block = path.read_text().split("## JSON lines", 1)[-1]
    return [json.loads(line) for line in block.splitlines() if line.startswith("{")]


def write_report(path: Path, total_s: float, rerun: list[str] | None = None) -> None:
    rows = ROWS
    when = f"on {time.strftime('%Y-%m-%d')}: real"
    if rerun is not None:  # other rows as the earlier run wrote them, in their order; re-run rows replace
        fresh = {(r["case"], r["backend"]): r for r in ROWS}
        rows = [fresh.pop((r["case"], r["backend"]), r) for r in _previous_rows(path)] + list(fresh.values())
        when = f"(rows of {', '.join(rerun)} re-run with `--cases` on {time.strftime('%Y-%m-%d')}): real"
        total_s = sum(r.get("seconds", 0) for r in rows)
    lines = [
        "# Reliability figures",
        "",
        f"Written by `make reliability` (`reliability/run.py`) {when} "
        f"`loraserve serve` processes on 127.0.0.1 with the tiny random Llama, {os.cpu_count()} CPUs, "
        f"{total_s:.0f} s in all. Each row's JSON line is below the table.",
        "",
        "| case | backend | figures | must be zero | ok |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        skip = {"case", "backend", "must_be_zero", "ok", "seconds"}
        figures = ", ".join(f"{k}={v}" for k, v in row.items() if k not in skip and not isinstance(v, dict))
        zero = ", ".join(f"{k}={v}" for k, v in row["must_be_zero"].items())
        lines.append(
            f"| {row['case']} | {row['backend']} | {figures} | {zero} | {'yes' if row['ok'] else 'NO'} |"
        )
    outage = [r for r in rows if r["case"] == "outages" and "s3_stop" in r]
    if outage:
        lines += ["", "## Outages: what kept serving (status, error code, latency during the outage)", ""]
        lines += ["| outage | " + " | ".join(outage[0]["s3_stop"]["during"]) + " | recovery s |"]
        lines += ["|---" * (len(outage[0]["s3_stop"]["during"]) + 2) + "|"]
        for name in ("s3_stop", "s3_hang", "postgres_cut"):
            during = outage[0][name]["during"]
            lines.append(
                f"| {name} | " + " | ".join(during.values()) + f" | {outage[0][name]['recovery_s']} |"
            )
    lines += ["", "## JSON lines", "", "```"] + [json.dumps(r) for r in rows] + ["```", ""]
    path.write_text("\n".join(lines))
