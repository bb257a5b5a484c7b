"""The shared API server: one real `loraserve serve` per backend for the whole session.

`server` (session scope, parametrized): "sqlite-local" = SQLite + LocalStore in the data dir;
"postgres-s3" = a database on the throwaway PostgreSQL cluster + a bucket on moto's S3 server (its
AWS_* variables go to the subprocess only). Both serve the tiny random Llama with `main_server_args`
(small context and limits). Tests create their own tenants (unique names) through the admin API, so
they do not depend on each other; a test that needs other options launches its own with
`tests.harness.servers.launch_server`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.postgres import new_database
from tests.harness.s3 import s3_backend
from tests.harness.servers import Server, launch_server, main_server_args


@pytest.fixture(scope="session", params=["sqlite-local", "postgres-s3"])
def server(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp(f"server-{request.param}")
    args = main_server_args(tiny_llama_dir)
    env: dict[str, str] = {}
    s3 = None
    if request.param == "postgres-s3":
        db_url = new_database(request.getfixturevalue("postgres_url"))
        s3 = s3_backend(request.getfixturevalue("s3_server"), tmp)
        args += ["--db", db_url, "--registry", f"s3://{s3['bucket']}/registry"]
        env = {k: v for k, v in s3.items() if k.startswith("AWS_")}
    with launch_server(args, tmp / "data", env=env, backend=request.param, s3=s3) as started:
        yield started
