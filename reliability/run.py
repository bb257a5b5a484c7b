"""The reliability suite: real `loraserve serve` processes on 127.0.0.1, hostile and unlucky
clients, one JSON line per case on stdout and a figures table in RELIABILITY.md.

Cases: abort storm, hostile uploads (both backends), mixed load, kill -9 mid-load + restart,
dependency outages (PostgreSQL restart, S3 stop and hang), schemathesis over /openapi.json, subnormal
and overflowing adapters, forged keys with large bodies, fairness between tenants (long streams, a lone
tenant, fan-out, stop bounds), and on one server with the shipped defaults (infra): import across
tenants, trickling uploads, hung store, hung postgres. Each case is
bounded by timeouts; a case that fails to run prints a row with its error instead of figures. Run with
`make reliability`; `--cases schemathesis,outages` re-runs only those cases and keeps the other rows of
RELIABILITY.md.

This file runs the cases in order; each case lives in a module of its own next to it (common, load,
hostile, faults, fuzz, numeric, forged_keys, fairness, infra) and report writes RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from base_engine.testing.checkpoint import save_random_checkpoint  # noqa: E402
from reliability.common import ROWS, SERVER_ENV, run_case  # noqa: E402
from reliability.fairness import FAIRNESS_CASES, fairness_server  # noqa: E402
from reliability.faults import case_kill9, case_outages  # noqa: E402
from reliability.forged_keys import case_forged_key_bodies  # noqa: E402
from reliability.fuzz import case_schemathesis  # noqa: E402
from reliability.hostile import case_hostile_uploads  # noqa: E402
from reliability.infra import (  # noqa: E402
    InfraServer,
    case_hung_postgres,
    case_hung_store,
    case_import_across_tenants,
    case_trickling_uploads,
    start_infra_server,
)
from reliability.load import case_abort_storm, case_load  # noqa: E402
from reliability.numeric import case_overflowing_adapters, case_subnormal_adapters  # noqa: E402
from reliability.report import write_report  # noqa: E402
from tests.harness.postgres import NoPostgres, new_database, postgres_cluster  # noqa: E402
from tests.harness.s3 import s3_backend  # noqa: E402
from tests.harness.servers import ADMIN_KEY, Server, ServerProcess, main_server_args  # noqa: E402

CASES = (
    "abort storm", "hostile uploads", "mixed load", "kill -9 + restart", "outages", "schemathesis",
    "subnormal adapters", "overflowing adapters", "forged-key bodies",
    *FAIRNESS_CASES,
    "import across tenants", "trickling uploads", "hung store", "hung postgres",
)  # fmt: skip
INFRA_CASES = ("import across tenants", "trickling uploads", "hung store", "hung postgres")  # in this order
ON_SQLITE = {"abort storm", "hostile uploads", "mixed load", "subnormal adapters", "forged-key bodies"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases", help=f"comma-separated case names to run (default: all): {', '.join(CASES)}"
    )
    opts = parser.parse_args(argv)
    selected = [c.strip() for c in opts.cases.split(",")] if opts.cases else list(CASES)
    unknown = [c for c in selected if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")

    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="loraserve-reliability-"))
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        _run_cases(selected, stack, tmp)
    rerun = None if opts.cases is None else selected
    write_report(ROOT / "RELIABILITY.md", time.monotonic() - start, rerun)
    return 0 if all(r["ok"] for r in ROWS) else 1


def _run_cases(selected: list[str], stack: ExitStack, tmp: Path) -> None:
    """The selected cases in a fixed order, on servers shared where a case leaves them usable; what they
    start is stopped by `stack`."""
    names = ("storm", "hostile-l", "hostile-s", "load", "storm-s", "kill9", "outage", "subnormal", "overflow")
    for name in (*names, "fair", "infra"):
        (tmp / name).mkdir()
    model = save_random_checkpoint(tmp / "model", arch="llama")
    s3_server = pg_url = ""
    if {"abort storm", "hostile uploads", "outages", *INFRA_CASES} & set(selected):  # on postgres-s3
        s3_server = _moto_server(stack)
        pg_url = _postgres_cluster(stack)
    server = _server_factory(stack, tmp, model, s3_server, pg_url)

    def want(case: str) -> bool:
        return case in selected

    sqlite = server("sqlite-local") if ON_SQLITE & set(selected) else None
    pgs3 = server("postgres-s3") if {"abort storm", "hostile uploads"} & set(selected) else None
    if want("abort storm"):
        run_case("abort storm", "sqlite-local", lambda: case_abort_storm(sqlite, tmp / "storm"))
    if want("hostile uploads"):
        run_case("hostile uploads", "sqlite-local", lambda: case_hostile_uploads(sqlite, tmp / "hostile-l"))
        run_case("hostile uploads", "postgres-s3", lambda: case_hostile_uploads(pgs3, tmp / "hostile-s"))
    if want("mixed load"):
        run_case("mixed load", "sqlite-local", lambda: case_load(sqlite, tmp / "load"))
    if want("abort storm"):
        run_case("abort storm", "postgres-s3", lambda: case_abort_storm(pgs3, tmp / "storm-s"))
    if want("kill -9 + restart"):
        run_case("kill -9 + restart", "sqlite-local", lambda: case_kill9(model, tmp / "kill9"))
    if want("outages"):
        run_case("outages", "postgres-s3", lambda: case_outages(model, tmp / "outage", pg_url, s3_server))
    if want("subnormal adapters"):
        run_case(
            "subnormal adapters", "sqlite-local", lambda: case_subnormal_adapters(sqlite, tmp / "subnormal")
        )
    if want("overflowing adapters"):  # a server of its own, on a base with 1e12 activations
        run_case(
            "overflowing adapters", "sqlite-local", lambda: case_overflowing_adapters(model, tmp / "overflow")
        )
    if want("forged-key bodies"):
        run_case("forged-key bodies", "sqlite-local", lambda: case_forged_key_bodies(sqlite))
    if want("schemathesis"):  # a server of its own: the fuzzer creates tenants, keys and deletes
        run_case("schemathesis", "sqlite-local", lambda: case_schemathesis(server("sqlite-local")))
    fair = [name for name in FAIRNESS_CASES if want(name)]
    if fair:  # a server of their own: 32 in-flight slots, so one tenant can fill them
        fair_server = fairness_server(stack, tmp / "fair", model)
        for name in fair:
            run_case(name, "sqlite-local", lambda case=FAIRNESS_CASES[name]: case(fair_server))
    _run_infra_cases([c for c in INFRA_CASES if want(c)], stack, tmp / "infra", model, pg_url, s3_server)


def _run_infra_cases(
    selected: list[str], stack: ExitStack, tmp: Path, model: Path, pg_url: str, s3_server: str
) -> None:
    """reliability/infra.py's rows, in INFRA_CASES order, on one server with the shipped defaults."""
    if not selected:
        return
    started: list[InfraServer] = []

    def infra() -> InfraServer:  # started by the first case, so a failed start is that row's error
        if not started:
            started.append(start_infra_server(stack, tmp, model, pg_url, s3_server))
        return started[0]

    cases = {
        "import across tenants": case_import_across_tenants,
        "trickling uploads": case_trickling_uploads,
        "hung store": case_hung_store,
        "hung postgres": case_hung_postgres,
    }
    for case in selected:
        run_case(case, "postgres-s3-hanging", lambda fn=cases[case]: fn(infra()))


def _server_factory(
    stack: ExitStack, tmp: Path, model: Path, s3_server: str, pg_url: str
) -> Callable[[str], Server]:
    """A function that starts a fresh server on a backend ("sqlite-local" or "postgres-s3")."""

    def server(backend: str) -> Server:
        d = tmp / f"{backend}-{uuid.uuid4().hex[:6]}"
        d.mkdir(parents=True)
        args, env, s3 = main_server_args(model), dict(SERVER_ENV), None
        if backend == "postgres-s3":
            s3 = s3_backend(s3_server, d)
            args += ["--db", new_database(pg_url), "--registry", f"s3://{s3['bucket']}/registry"]
            env |= {k: v for k, v in s3.items() if k.startswith("AWS_")}
        process = ServerProcess(args, d / "data", env=env).start()
        stack.callback(process.stop)
        return Server(process, ADMIN_KEY, backend, s3)

    return server


def _moto_server(stack: ExitStack) -> str:
    """moto's S3 server on 127.0.0.1 (stopped by `stack`); its endpoint URL."""
    from moto.server import ThreadedMotoServer

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    stack.callback(moto.stop)
    host, port = moto.get_host_and_port()
    return f"http://{host}:{port}"


def _postgres_cluster(stack: ExitStack) -> str:
    """A throwaway PostgreSQL cluster (stopped by `stack`); its admin URL."""
    try:
        return stack.enter_context(postgres_cluster())
    except NoPostgres as missing:
        raise SystemExit(str(missing)) from None


if __name__ == "__main__":
    raise SystemExit(main())
