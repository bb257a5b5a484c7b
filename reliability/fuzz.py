"""The schemathesis case: every operation of the served /openapi.json fuzzed with positive and negative
data within a request budget. Responses >= 500 are gated (with the server log around each); schema
conformance failures are counted and sampled, not gated."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from reliability.common import admin, auth
from tests.harness.servers import Server

ST_MAX_EXAMPLES = 20  # per operation and generation mode (positive, negative)
ST_BUDGET_S = 180.0  # the whole case's request budget; operations not reached are counted, not hidden
ST_REQUEST_TIMEOUT_S = 30.0


def _short(value: Any, limit: int = 300) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + f"...(+{len(text) - limit})"


@dataclass
class _Fuzzer:
    """One schemathesis run: where it aims, when its budget ends, and what it has counted so far."""

    base: str
    victim_id: str  # a real throwaway tenant: half the admin cases with a tenant_id aim at it
    log_path: Path  # the server's log, read after a 5xx for its traceback
    deadline: float  # time.monotonic() after which no request is sent
    requests_sent: int = 0
    transport_errors: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    server_errors: list[dict[str, Any]] = field(default_factory=list)
    conformance: dict[str, int] = field(default_factory=dict)
    conformance_samples: list[str] = field(default_factory=list)
    skipped_ops: set[str] = field(default_factory=set)
    no_negative: set[str] = field(default_factory=set)
    generation_errors: list[str] = field(default_factory=list)

    def fuzz(self, op: Any, mode: Any, headers: dict[str, str]) -> None:
        """Up to ST_MAX_EXAMPLES seeded cases of one operation in one generation mode."""
        import schemathesis
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis.errors import Unsatisfiable

        label, is_admin, seen = f"{op.method.upper()} {op.path}", op.path.startswith("/admin/"), [0]

        @settings(
            max_examples=ST_MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
            phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck),
        )  # fmt: skip
        @given(case=op.as_strategy(generation_mode=mode))
        def one(case: schemathesis.Case) -> None:
            if time.monotonic() > self.deadline:
                return
            seen[0] += 1
            if is_admin and "tenant_id" in (case.path_parameters or {}) and seen[0] % 2:
                case.path_parameters["tenant_id"] = self.victim_id
            self._send(case, label, mode, headers)

        try:
            one()
        except Unsatisfiable:  # negative data for an operation without parameters or body
            self.no_negative.add(label)
        except Exception as exc:  # the generator failed on this operation: reported, not hidden
            self.generation_errors.append(
                f"{label} {mode.value}: {type(exc).__name__}: {_short(str(exc), 200)}"
            )

    def _send(self, case: Any, label: str, mode: Any, headers: dict[str, str]) -> None:
        log_at = self.log_path.stat().st_size if self.log_path.exists() else 0
        try:
            response = case.call(base_url=self.base, headers=headers, timeout=ST_REQUEST_TIMEOUT_S)
        except Exception as exc:  # timeouts, resets: counted; /health checked at the end
            self.transport_errors += 1
            sys.stderr.write(f"schemathesis {label}: {type(exc).__name__}: {_short(str(exc))}\n")
            return
        self.requests_sent += 1
        code = response.status_code
        self.statuses[str(code)] = self.statuses.get(str(code), 0) + 1
        if code >= 500:
            self._server_error(case, label, mode, response, log_at)
        self._validate(case, label, response, headers)

    def _server_error(self, case: Any, label: str, mode: Any, response: Any, log_at: int) -> None:
        code = response.status_code
        time.sleep(0.2)  # the traceback reaches the log after the response
        with open(self.log_path, "rb") as f:
            f.seek(log_at)
            log = f.read().decode(errors="replace")
        self.server_errors.append({
            "operation": label, "status": code, "mode": mode.value,
            "path_parameters": case.path_parameters, "query": case.query,
            "body": _short(case.body, 2000), "response": _short(response.text, 500),
            "log": log[-6000:],
        })  # fmt: skip
        sys.stderr.write(f"schemathesis {code} on {label}: {case.as_curl_command()}\n{log}\n")

    def _validate(self, case: Any, label: str, response: Any, headers: dict[str, str]) -> None:
        from schemathesis.checks import not_a_server_error
        from schemathesis.core.failures import FailureGroup
        from schemathesis.specs.openapi.checks import ignored_auth

        try:
            case.validate_response(
                response, headers=headers, excluded_checks=[not_a_server_error, ignored_auth]
            )
        except (FailureGroup, Exception) as exc:  # FailureGroup is a BaseExceptionGroup
            for failure in getattr(exc, "exceptions", [exc]):
                title = f"{label}: {getattr(failure, 'title', type(failure).__name__)}"
                self.conformance[title] = self.conformance.get(title, 0) + 1
                if len(self.conformance_samples) < 40 and self.conformance[title] == 1:
                    self.conformance_samples.append(
                        f"{title} ({response.status_code}): {_short(str(failure), 400)}"
                    )


def case_schemathesis(server: Server) -> tuple[dict[str, Any], list[str]]:
    """Every operation of the served OpenAPI document, fuzzed with schemathesis (positive and negative
    data, bounded examples, seeded): tenant routes with a tenant key, admin routes with the admin key.
    Half the admin cases aim at a real throwaway tenant (the others at generated ids); DELETE operations
    run last so a deleted tenant does not starve the rest. Responses >= 500 must be 0; schema-conformance
    failures (status, content type, headers, body against the document) are reported, not gated."""
    import schemathesis

    base = server.base_url
    _, key = server.tenant("fuzz")
    victim_id, _ = server.tenant("fuzz-victim")
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json", config=schemathesis.Config())
    operations = [r.ok() for r in schema.get_all_operations()]
    operations.sort(key=lambda op: op.method.upper() == "DELETE")
    run = _Fuzzer(base, victim_id, server.process.log_path, time.monotonic() + ST_BUDGET_S)
    for op in operations:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            if time.monotonic() > run.deadline:
                run.skipped_ops.add(f"{op.method.upper()} {op.path}")
                continue
            run.fuzz(op, mode, admin() if op.path.startswith("/admin/") else auth(key))

    if run.conformance_samples:
        sys.stderr.write("schemathesis conformance failures (first of each):\n")
        sys.stderr.write("".join(f"  {line}\n" for line in run.conformance_samples))
    for err in run.server_errors:
        sys.stderr.write(json.dumps(err) + "\n")
    healthy = httpx.get(f"{base}/health", timeout=10).status_code == 200
    return {
        "operations": len(operations),
        "operations_not_reached": len(run.skipped_ops),
        "max_examples": ST_MAX_EXAMPLES,
        "requests": run.requests_sent,
        "statuses": dict(sorted(run.statuses.items())),
        "status_5xx": len(run.server_errors),
        "server_errors": [
            {k: e[k] for k in ("operation", "status", "path_parameters", "query", "body")}
            for e in run.server_errors[:10]
        ],
        "transport_errors": run.transport_errors,
        "no_negative_data": len(run.no_negative),
        "generation_errors": run.generation_errors,
        "conformance_failures": sum(run.conformance.values()),
        "conformance_by_check": dict(sorted(run.conformance.items())),
        "healthy_after": healthy,
    }, ["status_5xx"]
