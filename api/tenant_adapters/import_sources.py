"""Where an adapter may be imported from by reference: URI parsing, the operator's bound and each
tenant's allowlist.

A source is an object-store prefix holding `adapter_config.json` and `adapter_model.safetensors`:
`s3://bucket/prefix` (read with the server's own credentials, as LoRAX does) or, only when the
operator sets `adapter_import_allow_file`, a local `file:///dir`. Because the server reads it with
its own rights, a source must lie under one of `adapter_import_prefixes` (the operator's bound; empty:
imports are off) and under one of the importing tenant's own prefixes, which the admin grants that
tenant (`check_grant`, `PUT /admin/api/tenants/{id}/import-prefixes`; none: that tenant cannot
import), and never overlap this server's registry (every tenant's adapters) or, for `file://`, its data
directory (keys, database) — not even when an allowlisted prefix covers them (a source *above*
them is fine: only the two files directly under it are read). Prefixes match whole path
segments: `s3://b/team` covers `s3://b/team/x`, not `s3://b/team-b`. `.`/`..` segments are refused,
not normalized; `file://` paths are checked again with symlinks resolved (`resolve=True`) in the
import worker, so a link cannot lead out of an allowlisted directory.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from api.errors import APIError
from api.settings import Settings

logger = logging.getLogger(__name__)

_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")  # S3 bucket naming rules
_MAX_URI_CHARS = 2048


@dataclass(frozen=True, slots=True)
class ImportSource:
    scheme: str  # "s3" | "file"
    bucket: str  # the S3 bucket; "" for file://
    parts: tuple[str, ...]  # the prefix (s3) or absolute directory (file) as path segments

    @property
    def uri(self) -> str:
        """The URI `registry.stores.open_store` takes."""
        if self.scheme == "s3":
            return f"s3://{self.bucket}/{'/'.join(self.parts)}"
        return Path("/", *self.parts).as_uri()

    def is_under(self, other: ImportSource) -> bool:
        return (self.scheme, self.bucket) == (other.scheme, other.bucket) and (
            self.parts[: len(other.parts)] == other.parts
        )


def parse_source(uri: str, *, resolve: bool = False) -> ImportSource:
    """`s3://bucket/prefix` or `file:///dir` as an ImportSource; ValueError saying what is wrong.

    `resolve`: follow symlinks in a `file://` path (touches the file system)."""
    if len(uri) > _MAX_URI_CHARS:
        raise ValueError(f"uri is longer than {_MAX_URI_CHARS} characters")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in uri):  # NUL cannot even be stored in PostgreSQL
        raise ValueError("uri must not contain control characters")
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if parts.query or parts.fragment:
        raise ValueError("uri must not have a query or fragment")
    if scheme == "s3":
        if not _BUCKET.fullmatch(parts.netloc):
            raise ValueError("uri must be s3://bucket/prefix with a valid bucket name")
        path = parts.path
    elif scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError("a file:// uri must be local: file:///absolute/dir")
        path = unquote(parts.path)
        if resolve:
            path = os.path.realpath(path)
    else:
        raise ValueError("uri must start with s3:// (or file:// where the operator allows it)")
    segments = tuple(path.strip("/").split("/")) if path.strip("/") else ()
    if any(s in ("", ".", "..") for s in segments):
        raise ValueError("uri must not contain empty, '.' or '..' path segments")
    return ImportSource(scheme, parts.netloc if scheme == "s3" else "", segments)


def _forbidden(message: str) -> APIError:
    return APIError(403, message, code="import_source_forbidden", param="uri")


def _allowed_prefixes(settings: Settings, *, resolve: bool) -> list[ImportSource]:
    allowed = []
    for prefix in settings.adapter_import_prefixes:
        try:
            allowed.append(parse_source(prefix, resolve=resolve))
        except ValueError as exc:  # fail closed: a malformed entry allows nothing
            logger.warning("adapter_import_prefixes entry %r ignored: %s", prefix, exc)
    return allowed


def _server_own(settings: Settings, *, resolve: bool) -> list[ImportSource]:
    """The registry and the data directory: never importable."""
    own = [parse_source(Path(os.path.abspath(settings.data_dir)).as_uri(), resolve=resolve)]
    try:
        own.append(parse_source(settings.registry_url, resolve=resolve))
    except ValueError:  # a registry URL this parser does not take (e.g. an odd bucket name)
        registry = urlsplit(settings.registry_url)
        own.append(ImportSource(registry.scheme.lower(), registry.netloc, ()))  # its whole bucket
    return own


def check_source(settings: Settings, uri: str, *, resolve: bool = False) -> ImportSource:
    """The source `uri` names if this server may import from it; else 400 (malformed) or 403 naming
    the setting that refuses it. `resolve`: check `file://` paths with symlinks resolved."""
    try:
        source = parse_source(uri, resolve=resolve)
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value", param="uri") from None
    if source.scheme == "file" and not settings.adapter_import_allow_file:
        raise _forbidden("importing from file:// is off on this server (setting adapter_import_allow_file)")
    allowed = _allowed_prefixes(settings, resolve=resolve)
    if not allowed:
        raise _forbidden(
            "importing adapters by reference is off on this server: no source is allowed "
            "(setting adapter_import_prefixes is empty)"
        )
    if not any(source.is_under(prefix) for prefix in allowed):
        raise _forbidden("uri is not under any prefix the operator allows (setting adapter_import_prefixes)")
    if any(source.is_under(own) for own in _server_own(settings, resolve=resolve)):
        raise _forbidden("uri points into this server's own adapter registry or data: never importable")
    return source


def check_granted(source: ImportSource, granted: list[str], *, resolve: bool = False) -> None:
    """403 unless `source` lies under one of the tenant's `granted` prefixes (malformed ones allow
    nothing)."""
    if not granted:
        raise _forbidden(
            "importing adapters by reference is not enabled for this tenant: the admin grants it "
            "prefixes (import_prefixes)"
        )
    prefixes = []
    for prefix in granted:
        try:
            prefixes.append(parse_source(prefix, resolve=resolve))
        except ValueError:
            continue
    if not any(source.is_under(prefix) for prefix in prefixes):
        raise _forbidden("uri is not under any prefix this tenant may import from (import_prefixes)")


def check_grant(settings: Settings, prefix: str) -> str:
    """`prefix` in canonical form if the admin may grant it to a tenant: well-formed, within the
    operator's bound (`adapter_import_prefixes`, `adapter_import_allow_file`), and not into this
    server's registry or data; else 400 naming what refuses it."""
    try:
        return check_source(settings, prefix).uri
    except APIError as exc:
        raise APIError(
            400, f"prefix {prefix[:200]!r}: {exc.message}", code="invalid_value", param="prefixes"
        ) from None


def check_local_object(source: ImportSource, key: str) -> None:
    """Refuse an object of a `file://` source that is a symlink leading out of its directory."""
    directory = Path("/", *source.parts)
    if Path(os.path.realpath(directory / key)).parent != directory:
        raise _forbidden(f"{key} in the import directory is a link to a file elsewhere; that is refused")
