"""`open_store(url)`: the object-store backend a URL names.

`file:///abs/dir` is a `LocalStore` (registry/store.py), `s3://bucket/prefix` an `S3Store`
(registry/s3.py; boto3 is imported only when S3 is used).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from registry.store import LocalStore, ObjectStore


def open_store(
    url: str, *, max_attempts: int = 3, connect_timeout_s: float = 3.0, read_timeout_s: float = 20.0
) -> ObjectStore:
    """`file:///abs/dir` -> LocalStore, `s3://bucket/prefix` -> S3Store (boto3 resolves endpoint and
    credentials itself: AWS_ENDPOINT_URL, profiles, env). `max_attempts` bounds S3 attempts per call,
    the timeouts bound each attempt (registry/s3.py)."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file:// store URL must be local (file:///path), got {url!r}")
        return LocalStore(Path(unquote(parsed.path)))
    if parsed.scheme == "s3":
        from registry.s3 import S3Store  # boto3 is imported only when S3 is used

        return S3Store(
            bucket=parsed.netloc,
            prefix=parsed.path.strip("/"),
            max_attempts=max_attempts,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
        )
    raise ValueError(f"store URL must start with file:// or s3://, got {url!r}")
