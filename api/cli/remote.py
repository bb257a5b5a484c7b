"""`loraserve tenant|key|adapter ...` over HTTP against a running server.

The server is `--url` (or `LORASERVE_URL`, default http://127.0.0.1:8000). Keys come from the
environment so that they never show in a process list or shell history: `LORASERVE_ADMIN_KEY` for the
admin commands (tenants, keys), `LORASERVE_API_KEY` (a tenant key) for the adapter commands;
`--admin-key` / `--api-key` exist for scripts that cannot set the environment. Errors print the
server's message and exit 1. `--json` prints the server's JSON instead of a table.
"""

from __future__ import annotations

import json
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

DEFAULT_URL = "http://127.0.0.1:8000"
UPLOAD_FILES = ("adapter_config.json", "adapter_model.safetensors")
_CHUNK = 256 << 10

UrlOpt = Annotated[
    str,
    typer.Option("--url", envvar="LORASERVE_URL", help="base URL of the running server", show_envvar=True),
]
AdminKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--admin-key",
        envvar="LORASERVE_ADMIN_KEY",
        help="admin key (lsa-...); prefer the environment",
        show_default=False,
    ),
]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="LORASERVE_API_KEY",
        help="tenant API key (lsk-...); prefer the environment",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print the server's JSON")]
TimeoutOpt = Annotated[float, typer.Option(help="seconds to wait for the server")]


def fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(1)


class Remote:
    """One server and one key; every call returns the JSON body or exits with the server's message."""

    def __init__(self, url: str, key: str | None, key_name: str, timeout: float = 60.0) -> None:
        if not key:
            raise fail(
                f"no key: set {key_name} (or pass --{key_name.split('_', 1)[1].lower().replace('_', '-')})"
            )
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {key}"}
        self.timeout = timeout

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        headers = {**self.headers, **kwargs.pop("headers", {})}
        try:
            r = httpx.request(method, self.url + path, headers=headers, timeout=self.timeout, **kwargs)
        except httpx.HTTPError as exc:
            raise fail(f"cannot reach {self.url}: {exc}") from None
        try:
            body = r.json()
        except ValueError:
            body = None
        if r.status_code >= 400:
            error = body.get("error") if isinstance(body, dict) else None
            message = error.get("message") if isinstance(error, dict) else (r.text[:300] or r.reason_phrase)
            raise fail(f"{r.status_code}: {message}")
        return body


def _admin(url: str, key: str | None, timeout: float = 60.0) -> Remote:
    return Remote(url, key, "LORASERVE_ADMIN_KEY", timeout)


def _tenant(url: str, key: str | None, timeout: float = 60.0) -> Remote:
    return Remote(url, key, "LORASERVE_API_KEY", timeout)


def _print(rows: list[dict[str, Any]], columns: list[str], as_json: bool, raw: Any) -> None:
    if as_json:
        typer.echo(json.dumps(raw, indent=2))
        return
    if not rows:
        typer.echo("(none)")
        return
    cells = [[("" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    typer.echo("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for row in cells:
        typer.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def _tenant_id(remote: Remote, tenant: str) -> str:
    """A tenant given by id or by name."""
    tenants = remote.call("GET", "/admin/api/tenants")["data"]
    for t in tenants:
        if tenant in (t["id"], t["name"]):
            return str(t["id"])
    raise fail(f"no tenant {tenant!r} (by id or name)")


# ---- tenants --------------------------------------------------------------------------------------


def tenant_list(url: UrlOpt = DEFAULT_URL, admin_key: AdminKeyOpt = None, as_json: JsonOpt = False) -> None:
    """List tenants (admin key)."""
    body = _admin(url, admin_key).call("GET", "/admin/api/tenants")
    _print(body["data"], ["id", "name", "status", "created_at"], as_json, body)


def tenant_priority(
    tenant: Annotated[str, typer.Argument(help="tenant id or name")],
    level: Annotated[
        int, typer.Option("--level", help="default priority, lower = more urgent", min=-1000, max=1000)
    ],
    url: UrlOpt = DEFAULT_URL,
    admin_key: AdminKeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Set a tenant's default priority (admin key): its requests' level when they name none, and the
    most urgent one they may ask for."""
    remote = _admin(url, admin_key)
    tenant_id = _tenant_id(remote, tenant)
    body = remote.call("PUT", f"/admin/api/tenants/{tenant_id}/priority", json={"default_priority": level})
    _print([body], ["id", "name", "default_priority"], as_json, body)


def tenant_delete(
    tenant: Annotated[str, typer.Argument(help="tenant id or name")],
    url: UrlOpt = DEFAULT_URL,
    admin_key: AdminKeyOpt = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="do not ask for confirmation")] = False,
) -> None:
    """Delete a tenant (admin key): its keys and adapters stop working at once."""
    remote = _admin(url, admin_key)
    tenant_id = _tenant_id(remote, tenant)
    if not yes:
        typer.confirm(f"delete tenant {tenant} ({tenant_id})?", abort=True)
    remote.call("DELETE", f"/admin/api/tenants/{tenant_id}")
    typer.echo(f"deleted tenant {tenant} ({tenant_id})")


# ---- keys -----------------------------------------------------------------------------------------


def key_create(
    tenant: Annotated[str, typer.Argument(help="tenant id or name")],
    url: UrlOpt = DEFAULT_URL,
    admin_key: AdminKeyOpt = None,
    label: Annotated[str | None, typer.Option(help="a note kept with the key")] = None,
) -> None:
    """Issue a new API key for a tenant (admin key); the key is printed once, on stdout."""
    remote = _admin(url, admin_key)
    tenant_id = _tenant_id(remote, tenant)
    body = remote.call(
        "POST", f"/admin/api/tenants/{tenant_id}/keys", json={"label": label} if label else None
    )
    typer.echo(f"key {body['prefix']} for tenant {tenant} ({tenant_id})", err=True)
    typer.echo(body["api_key"])


def key_list(
    tenant: Annotated[str, typer.Argument(help="tenant id or name")],
    url: UrlOpt = DEFAULT_URL,
    admin_key: AdminKeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List a tenant's keys by prefix (admin key)."""
    remote = _admin(url, admin_key)
    body = remote.call("GET", f"/admin/api/tenants/{_tenant_id(remote, tenant)}/keys")
    _print(body["data"], ["prefix", "label", "created_at", "revoked_at"], as_json, body)


def key_revoke(
    tenant: Annotated[str, typer.Argument(help="tenant id or name")],
    prefix: Annotated[str, typer.Argument(help="the key's prefix (from `key list`)")],
    url: UrlOpt = DEFAULT_URL,
    admin_key: AdminKeyOpt = None,
) -> None:
    """Revoke a tenant's key (admin key); requests with it fail at once."""
    remote = _admin(url, admin_key)
    tenant_id = _tenant_id(remote, tenant)
    remote.call("DELETE", f"/admin/api/tenants/{tenant_id}/keys/{prefix}")
    typer.echo(f"revoked key {prefix} of tenant {tenant}")


# ---- adapters ---------------------------------------------------------------------------------------


def adapter_list(url: UrlOpt = DEFAULT_URL, api_key: ApiKeyOpt = None, as_json: JsonOpt = False) -> None:
    """List your adapters and their versions (tenant key)."""
    body = _tenant(url, api_key).call("GET", "/v1/adapters")
    rows = [
        {**v, "latest": "*" if v["version"] == a["latest_version"] else ""}
        for a in body["data"]
        for v in a["versions"]
    ]
    _print(
        rows, ["name", "version", "latest", "status", "rank", "size", "residency", "sha256"], as_json, body
    )


def adapter_delete(
    name: Annotated[str, typer.Argument(help="adapter name")],
    url: UrlOpt = DEFAULT_URL,
    api_key: ApiKeyOpt = None,
    version: Annotated[
        int | None, typer.Option(help="delete only this version [default: all versions]")
    ] = None,
) -> None:
    """Delete an adapter, or one version of it (tenant key); it stops serving at once."""
    params = {"version": version} if version is not None else None
    body = _tenant(url, api_key).call("DELETE", f"/v1/adapters/{name}", params=params)
    typer.echo(f"deleted {name} versions {', '.join(str(v) for v in body['versions'])}")


def multipart_body(name: str, directory: Path) -> tuple[str, list[bytes | Path], int]:
    """(content type, parts, total bytes) of the upload: the `name` field, then one `files` part per file.
    File parts are read lazily, so a large adapter is never held in memory whole."""
    boundary = "loraserve-" + secrets.token_hex(12)
    parts: list[bytes | Path] = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\n{name}\r\n'.encode()
    ]
    for filename in UPLOAD_FILES:
        path = directory / filename
        if not path.is_file():
            raise fail(
                f"{directory} has no {filename} (a PEFT adapter directory has {', '.join(UPLOAD_FILES)})"
            )
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{filename}"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n".encode()
        )
        parts.append(path)
        parts.append(b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    total = sum(p.stat().st_size if isinstance(p, Path) else len(p) for p in parts)
    return f"multipart/form-data; boundary={boundary}", parts, total


def _stream(parts: list[bytes | Path], progress: Any) -> Iterator[bytes]:
    for part in parts:
        if isinstance(part, bytes):
            progress.update(len(part))
            yield part
            continue
        with part.open("rb") as f:
            while chunk := f.read(_CHUNK):
                progress.update(len(chunk))
                yield chunk


def push_over_http(directory: Path, name: str, url: str, api_key: str | None, timeout: float) -> None:
    """Upload a PEFT adapter directory as the caller's next version of `name`, with a progress bar."""
    remote = _tenant(url, api_key, timeout)
    content_type, parts, total = multipart_body(name, directory)
    with typer.progressbar(length=total, label=f"uploading {name}", file=sys.stderr) as progress:
        body = remote.call(
            "POST",
            "/v1/adapters",
            content=_stream(parts, progress),
            headers={"Content-Type": content_type, "Content-Length": str(total)},
        )
    modules = ",".join(body.get("modules", []))
    typer.echo(
        f"{body['name']}@{body['version']} sha256={body['sha256']} rank={body['rank']} modules={modules}"
    )


def register(tenant_app: typer.Typer, key_app: typer.Typer, adapter_app: typer.Typer) -> None:
    """Adds the HTTP commands to the `loraserve` command groups."""
    tenant_app.command("list")(tenant_list)
    tenant_app.command("delete")(tenant_delete)
    tenant_app.command("priority")(tenant_priority)
    key_app.command("create")(key_create)
    key_app.command("list")(key_list)
    key_app.command("revoke")(key_revoke)
    adapter_app.command("list")(adapter_list)
    adapter_app.command("delete")(adapter_delete)
