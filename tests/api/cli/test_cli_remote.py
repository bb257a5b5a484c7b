"""`loraserve tenant|key|adapter` over HTTP against a real server (the `loraserve` Typer app run in
process by Typer's CliRunner; keys from the environment), and `--help` showing every option's default."""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest
from typer.testing import CliRunner

from api.cli.main import app
from tests.harness.servers import Server
from tests.harness.uploads import peft_adapter

SQLITE = pytest.mark.parametrize("server", ["sqlite-local"], indirect=True)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return peft_adapter(tmp_path_factory.mktemp("cli") / "a")


def run(server: Server, *args: str, key: str | None = None, admin: bool = False) -> tuple[int, str, str]:
    env = {"LORASERVE_URL": server.base_url}
    if admin:
        env["LORASERVE_ADMIN_KEY"] = server.admin_key
    if key:
        env["LORASERVE_API_KEY"] = key
    result = CliRunner().invoke(app, list(args), env=env)
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.slow
@SQLITE
def test_tenant_and_key_lifecycle(server: Server) -> None:
    tenant_id, _ = server.tenant("cli")
    code, out, _ = run(server, "tenant", "list", "--json", admin=True)
    assert code == 0 and tenant_id in {t["id"] for t in json.loads(out)["data"]}
    code, out, _ = run(server, "tenant", "list", admin=True)
    assert code == 0 and out.splitlines()[0].split() == ["ID", "NAME", "STATUS", "CREATED_AT"]

    code, out, err = run(server, "key", "create", tenant_id, "--label", "ci", admin=True)
    assert code == 0, err
    new_key = out.strip()
    assert new_key.startswith("lsk-")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=new_key, max_retries=0)
    assert client.models.list().data
    code, out, _ = run(server, "key", "list", tenant_id, "--json", admin=True)
    prefixes = [k["prefix"] for k in json.loads(out)["data"] if k["label"] == "ci"]
    assert code == 0 and len(prefixes) == 1 and new_key.startswith(f"lsk-{prefixes[0]}")
    code, _, err = run(server, "key", "revoke", tenant_id, prefixes[0], admin=True)
    assert code == 0, err
    with pytest.raises(openai.AuthenticationError):
        client.models.list()

    code, _, err = run(server, "tenant", "delete", tenant_id, "--yes", admin=True)
    assert code == 0, err
    code, out, _ = run(server, "tenant", "list", "--json", admin=True)
    assert tenant_id not in {t["id"] for t in json.loads(out)["data"] if t["status"] != "deleted"}


@pytest.mark.slow
@SQLITE
def test_adapter_push_list_delete_over_http(server: Server, adapter_dir: Path) -> None:
    _, key = server.tenant("clia")
    code, out, err = run(server, "adapter", "push", str(adapter_dir), "--name", "cli-bot", key=key)
    assert code == 0, err
    assert out.startswith("cli-bot@1 sha256=")
    assert "uploading cli-bot" in err  # the progress bar's label
    code, out, _ = run(server, "adapter", "list", "--json", key=key)
    assert [a["name"] for a in json.loads(out)["data"]] == ["cli-bot"]
    code, out, _ = run(server, "adapter", "list", key=key)
    assert code == 0 and "cli-bot" in out and "NAME" in out.splitlines()[0]
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
    assert client.completions.create(model="cli-bot", prompt="Hi", max_tokens=2).choices
    code, out, err = run(server, "adapter", "delete", "cli-bot", key=key)
    assert code == 0 and "versions 1" in out, err
    code, out, _ = run(server, "adapter", "list", "--json", key=key)
    assert json.loads(out)["data"] == []


@pytest.mark.slow
@SQLITE
def test_errors_are_clear(server: Server, adapter_dir: Path, tmp_path: Path) -> None:
    code, _, err = run(server, "adapter", "list")
    assert code == 1 and "LORASERVE_API_KEY" in err
    code, _, err = run(server, "adapter", "list", key="lsk-not-a-key")
    assert code == 1 and err.startswith("error: 401")
    code, _, err = run(server, "adapter", "push", str(tmp_path), "--name", "x", key="lsk-whatever")
    assert code == 1 and "adapter_config.json" in err
    code, _, err = run(server, "key", "create", "no-such-tenant", admin=True)
    assert code == 1 and "no tenant" in err


def test_help_shows_every_default() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"])
    assert result.exit_code == 0
    entries: list[str] = []  # one per option, wrapped lines joined
    for line in result.stdout.split("Options:", 1)[1].splitlines():
        if re.match(r"\s+--", line):
            entries.append(line.strip())
        elif entries and line.strip():
            entries[-1] += " " + line.strip()
    entries = [e for e in entries if not e.startswith("--help")]
    assert len(entries) > 15
    for entry in entries:
        assert "[default: " in entry, entry
    assert "address to bind [default: 127.0.0.1]" in " ".join(entries)
