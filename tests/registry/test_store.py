"""Object stores: LocalStore and S3Store (moto's S3 server over HTTP) behind the same tests."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import pytest

from registry.errors import HashMismatch, ObjectNotFound, StoreUnavailable
from registry.s3 import S3Store
from registry.store import ObjectStore, content_key, get_verified, put_content
from registry.stores import open_store


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_put_get_exists_delete_list(store: ObjectStore, tmp_path: Path) -> None:
    store.check()
    src = _file(tmp_path / "a.bin", b"hello")
    assert not store.exists("x/a")
    store.put("x/a", src)
    store.put("x/b", _file(tmp_path / "b.bin", b"world"))
    store.put("y/c", src)
    assert store.exists("x/a")
    assert sorted(store.list("x/")) == ["x/a", "x/b"]
    assert sorted(store.list()) == ["x/a", "x/b", "y/c"]
    store.get("x/b", tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == b"world"
    store.delete("x/a")
    store.delete("x/a")  # deleting a missing key is fine
    assert not store.exists("x/a")
    with pytest.raises(ObjectNotFound, match="'x/a' not found"):
        store.get("x/a", tmp_path / "missing")
    assert not (tmp_path / "missing").exists()


def test_keys_cannot_escape(store: ObjectStore, tmp_path: Path) -> None:
    src = _file(tmp_path / "a.bin", b"x")
    for bad in ("../a", "/abs", "a//b", "a/./b", ""):
        with pytest.raises(ValueError, match="object key"):
            store.put(bad, src)


def test_content_addressing_is_idempotent_and_verified(store: ObjectStore, tmp_path: Path) -> None:
    data = os.urandom(1000)
    sha = put_content(store, _file(tmp_path / "a.bin", data))
    assert sha == hashlib.sha256(data).hexdigest()
    assert list(store.list()) == [content_key(sha)]
    assert put_content(store, _file(tmp_path / "same.bin", data)) == sha
    assert list(store.list()) == [content_key(sha)]
    get_verified(store, sha, tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == data


def test_hash_mismatch_never_becomes_visible(store: ObjectStore, tmp_path: Path) -> None:
    good = os.urandom(100)
    sha = hashlib.sha256(good).hexdigest()
    store.put(content_key(sha), _file(tmp_path / "evil.bin", b"tampered bytes"))  # corrupt object
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(HashMismatch, match=f"expected {sha}"):
        get_verified(store, sha, out / "dest")
    assert list(out.iterdir()) == []  # no dest, no temp file


def test_open_store_urls(tmp_path: Path) -> None:
    local = open_store(f"file://{tmp_path}/objs")
    assert local.url == (tmp_path / "objs").as_uri()
    for bad in ("http://x/y", "file://host/dir", "ftp://a"):
        with pytest.raises(ValueError, match="store URL"):
            open_store(bad)


def test_s3_multipart_upload_round_trip(s3_bucket: str, tmp_path: Path) -> None:
    # 5 MiB is S3's smallest multipart part: an 11 MiB file goes up in three parts.
    store = S3Store(bucket=s3_bucket, prefix="p", multipart_threshold=5 << 20, multipart_chunksize=5 << 20)
    data = os.urandom(11 << 20)
    sha = put_content(store, _file(tmp_path / "big.bin", data))
    get_verified(store, sha, tmp_path / "back")
    assert hashlib.sha256((tmp_path / "back").read_bytes()).hexdigest() == sha
    assert list(store.list()) == [content_key(sha)]
    import boto3

    head = boto3.session.Session().client("s3").head_object(Bucket=s3_bucket, Key=f"p/{content_key(sha)}")
    assert head["ETag"].strip('"').endswith("-3")  # S3's mark of a 3-part multipart object


def test_s3_missing_bucket_is_unavailable(s3_env: dict[str, str], tmp_path: Path) -> None:
    store = open_store("s3://no-such-bucket-here/x", max_attempts=1)
    with pytest.raises(StoreUnavailable, match="bucket 'no-such-bucket-here' does not exist"):
        store.check()
    with pytest.raises(StoreUnavailable, match="bucket 'no-such-bucket-here' does not exist"):
        store.put("k", _file(tmp_path / "a", b"a"))


def test_s3_endpoint_down_is_unavailable(
    s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    store = open_store("s3://bucket/x", max_attempts=2)
    with pytest.raises(StoreUnavailable, match=f"cannot reach S3 endpoint http://127.0.0.1:{port}"):
        store.check()
    with pytest.raises(StoreUnavailable, match="cannot reach"):
        store.put("k", _file(tmp_path / "a", b"a"))
    with pytest.raises(StoreUnavailable, match="cannot reach"):
        store.get("k", tmp_path / "b")
    assert not (tmp_path / "b").exists()
