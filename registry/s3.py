"""`S3Store`: the object-store protocol on any S3-compatible endpoint (AWS, MinIO, R2) via boto3.

boto3 resolves the endpoint and credentials exactly as for any AWS user (`AWS_ENDPOINT_URL`,
profiles, environment); nothing here reads the environment. Large files go multipart through
boto3's TransferConfig; throttling, 5xx, connection errors and timeouts are retried with botocore's
standard retry mode (exponential backoff with jitter) up to `max_attempts` attempts in all. Every
attempt has a connect timeout and a read timeout (the longest silence on an open connection), so a
hung endpoint costs a call at most about `max_attempts * (connect + read)` seconds plus backoff,
never forever. Failures become `StoreUnavailable` with the bucket and endpoint named, or
`ObjectNotFound` for a missing key.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import boto3
import botocore.exceptions as bce
from boto3.exceptions import RetriesExceededError, S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from registry.errors import ObjectNotFound, StoreUnavailable
from registry.store import check_key

_MIB = 1 << 20
_DENIED = {"AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch"}
_MISSING_KEY = {"NoSuchKey", "404", "NotFound"}
_UNREACHABLE = (
    bce.EndpointConnectionError,
    bce.ConnectTimeoutError,
    bce.ReadTimeoutError,
    bce.ConnectionClosedError,
    RetriesExceededError,
)


class S3Store:
    """Objects under `s3://bucket/prefix/<key>`."""

    def __init__(
        self,
        *,
        bucket: str,
        prefix: str = "",
        max_attempts: int = 3,
        connect_timeout_s: float = 3.0,
        read_timeout_s: float = 20.0,
        multipart_threshold: int = 16 * _MIB,
        multipart_chunksize: int = 16 * _MIB,
    ) -> None:
        if not bucket:
            raise ValueError("S3 store URL needs a bucket: s3://bucket/prefix")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if connect_timeout_s <= 0 or read_timeout_s <= 0:
            raise ValueError(f"timeouts must be > 0, got {connect_timeout_s=}, {read_timeout_s=}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        config = Config(
            retries={"mode": "standard", "max_attempts": max_attempts},
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            tcp_keepalive=True,
        )
        self._client = boto3.session.Session().client("s3", config=config)
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=4,
        )

    @property
    def endpoint(self) -> str:
        return str(self._client.meta.endpoint_url)

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    @contextlib.contextmanager
    def _errors(self, op: str, key: str = "") -> Iterator[None]:
        """Translate boto3/botocore failures into the registry's errors, naming what was tried."""
        where = f"{op} {self.url}/{key}" if key else f"{op} {self.url}"
        try:
            yield
        except _UNREACHABLE as e:
            raise StoreUnavailable(f"cannot reach S3 endpoint {self.endpoint} ({where}): {e}") from e
        except bce.NoCredentialsError as e:
            raise StoreUnavailable(f"no AWS credentials found for {where}: {e}") from e
        except S3UploadFailedError as e:
            cause = e.__context__
            if isinstance(cause, bce.ClientError):
                raise self._client_error(cause, where, key) from e
            raise StoreUnavailable(f"{where} failed at {self.endpoint}: {e}") from e
        except bce.ClientError as e:
            raise self._client_error(e, where, key) from e

    def _client_error(self, e: bce.ClientError, where: str, key: str) -> Exception:
        code = str(e.response.get("Error", {}).get("Code", ""))
        if code == "NoSuchBucket" or (code in _MISSING_KEY and not key):
            return StoreUnavailable(f"bucket {self.bucket!r} does not exist at {self.endpoint} ({where})")
        if code in _DENIED:
            return StoreUnavailable(f"access denied by {self.endpoint} ({where}): {e}")
        if code in _MISSING_KEY:
            return ObjectNotFound(self.url, key)
        return StoreUnavailable(f"{where} failed at {self.endpoint}: {e}")

    def check(self) -> None:
        with self._errors("head_bucket"):
            self._client.head_bucket(Bucket=self.bucket)

    def put(self, key: str, src: Path) -> None:
        with self._errors("put", key):
            self._client.upload_file(str(src), self.bucket, self._key(key), Config=self._transfer)

    def get(self, key: str, dest: Path) -> None:
        # s3transfer writes to a temp name and renames, so `dest` is whole or absent.
        with self._errors("get", key):
            self._client.download_file(self.bucket, self._key(key), str(dest), Config=self._transfer)

    def exists(self, key: str) -> bool:
        try:
            with self._errors("head", key):
                self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        except ObjectNotFound:
            return False
        return True

    def size(self, key: str) -> int:
        with self._errors("head", key):
            head = self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        return int(head["ContentLength"])

    def delete(self, key: str) -> None:
        with self._errors("delete", key):
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def list(self, prefix: str = "") -> Iterator[str]:
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0
        with self._errors("list", prefix):
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full)
            for page in pages:
                for obj in page.get("Contents", []):
                    yield obj["Key"][strip:]
