"""Provenance's parts without a server: the base model hash and its cache, the header's encoding, the
git sha, the journal carrying provenance across a crash, and the API's seed and `deterministic` rules."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import unquote

import pytest

import api.checkpoints.hashes
from api.checkpoints.gguf import CONVERSION_VERSION, MARKER_FILE
from api.checkpoints.hashes import CACHE_FILE, base_model_sha256
from api.inference.protocol import ChatCompletionRequest
from api.inference.provenance import git_sha, header_value
from api.inference.sampling import SeedSource, request_seed, sampling_params
from api.metering.journal import InFlightRequest, begin_line, finish_line, parse_line
from api.settings import Settings
from registry.provenance import Provenance
from tests.harness.structured_fields import parse_dictionary


def _listing_sha256(files: list[Path]) -> str:
    listing = "".join(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in files)
    return hashlib.sha256(listing.encode()).hexdigest()


def test_base_hash_is_cached_by_path_size_and_mtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, data = tmp_path / "model", tmp_path / "data"
    model.mkdir(), data.mkdir()
    shards = [model / "b.safetensors", model / "a.safetensors"]
    for i, shard in enumerate(shards):
        shard.write_bytes(bytes([i]) * 1000)
    (model / "config.json").write_text("{}")  # not a weight file: not hashed
    first = base_model_sha256(model, cache_dir=data)
    assert first == _listing_sha256(sorted(shards))
    assert len(json.loads((data / CACHE_FILE).read_text())) == 2

    def no_hashing(path: Path, **_: object) -> str:
        raise AssertionError(f"{path.name} was hashed again")

    monkeypatch.setattr(api.checkpoints.hashes, "file_sha256", no_hashing)
    assert base_model_sha256(model, cache_dir=data) == first  # a restart: only stat() calls
    monkeypatch.undo()
    shards[0].write_bytes(b"changed")  # new size and mtime: that file alone is hashed again
    assert base_model_sha256(model, cache_dir=data) == _listing_sha256(sorted(shards)) != first


def test_base_hash_follows_the_index_and_reuses_a_gguf_hash(tmp_path: Path) -> None:
    model = tmp_path / "sharded"
    model.mkdir()
    for name in ("model-00001.safetensors", "model-00002.safetensors", "stray.safetensors"):
        (model / name).write_bytes(name.encode())
    weight_map = {
        "x": "model-00002.safetensors",
        "y": "model-00001.safetensors",
        "z": "model-00002.safetensors",
    }
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = [model / "model-00001.safetensors", model / "model-00002.safetensors"]
    assert base_model_sha256(model, cache_dir=tmp_path) == _listing_sha256(loaded)

    converted = tmp_path / "sha256-feed"
    converted.mkdir()
    (converted / "model.safetensors").write_bytes(b"weights")
    marker = {"version": CONVERSION_VERSION, "source": "x.gguf", "sha256": "feed" * 16}
    (converted / MARKER_FILE).write_text(json.dumps(marker))
    assert base_model_sha256(converted, cache_dir=tmp_path) == "feed" * 16

    empty = tmp_path / "empty"
    empty.mkdir()
    assert base_model_sha256(empty, cache_dir=tmp_path) == "unknown"  # logged; never stops a start


def test_header_encodes_every_field_as_rfc8941() -> None:
    p = Provenance(
        base_model='modèle "x" \\ 100%',
        adapter="bot",
        adapter_version=3,
        seed=2**64 - 1,
        deterministic=True,
    )
    value = header_value(p)
    assert value.isascii()
    parsed = parse_dictionary(value)
    assert unquote(parsed["base_model"]) == p.base_model
    assert parsed["seed"] == str(2**64 - 1) and parsed["adapter_version"] == 3
    assert parsed["deterministic"] is True
    assert "adapter_sha256" not in parsed  # None fields are left out
    assert set(parsed) == {k for k, v in p.to_dict().items() if v is not None}


def test_git_sha_of_a_checkout_and_elsewhere(tmp_path: Path) -> None:
    assert git_sha(tmp_path) == "unknown"  # not a checkout, and no VCS install record

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True)  # fmt: skip
        return done.stdout.strip()

    git("init", "-q")
    (tmp_path / "f").write_text("1")
    git("add", "f")
    git("commit", "-q", "-m", "one")
    head = git("rev-parse", "HEAD")
    assert git_sha(tmp_path) == head
    (tmp_path / "untracked").write_text("x")
    assert git_sha(tmp_path) == head  # untracked files do not change what was built
    (tmp_path / "f").write_text("2")
    assert git_sha(tmp_path) == f"{head}-dirty"
    inner = tmp_path / "pkg"
    inner.mkdir()
    assert git_sha(inner) == "unknown"  # inside someone else's checkout: not ours to report


def test_journal_keeps_provenance_across_a_crash() -> None:
    now = datetime.now(UTC)
    provenance = Provenance(
        base_sha256="ab" * 32, adapter="bot", adapter_version=1, seed=5, deterministic=True
    )
    req = InFlightRequest("r1", "t", "k", "bot", 1, prompt_tokens=3, created_at=now, provenance=provenance)
    begun = parse_line(begin_line(req))
    assert begun == req
    aborted = req.aborted(now)
    assert aborted.provenance == provenance
    assert parse_line(finish_line(aborted)) == aborted
    old = json.loads(begin_line(req))
    del old["provenance"]  # a line written before provenance existed
    assert parse_line(json.dumps(old)).provenance is None  # type: ignore[union-attr]


def test_seeds_are_drawn_and_server_wide_deterministic_wins() -> None:
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], deterministic=False)
    source = SeedSource("secret")
    seeds = [request_seed(body, source, f"cmpl-{i}") for i in range(50)]
    assert len(set(seeds)) == 50 and all(0 <= s < 2**63 for s in seeds)
    assert request_seed(body.model_copy(update={"seed": -3}), source, "cmpl-0") == -3
    # The seed follows the secret, the server's seed and the request id (a restart replays it).
    again = SeedSource("secret")
    assert [again.draw(f"cmpl-{i}") for i in range(50)] == seeds
    assert SeedSource("secret", 1).draw("cmpl-0") != seeds[0]
    # A fleet replica's name: the given id, else one unique to the process.
    assert Settings(replica_id="r-1").replica_name == "r-1"
    assert Settings().replica_name == f"{socket.gethostname()}-{os.getpid()}"
    params = sampling_params(body, num_prompt=2, max_model_len=16, index=2, seed=10, deterministic=True)
    assert params.deterministic and params.seed == 12  # choice 2 of seed 10
    assert not sampling_params(body, num_prompt=2, max_model_len=16, index=0, seed=10).deterministic


def test_drawn_seeds_are_keyed_by_the_server_secret_and_the_request_id() -> None:
    # Two servers (two secrets) draw different seeds for the same request id; nothing is shared.
    first, second = SeedSource("secret-a"), SeedSource("secret-b")
    ids = [f"chatcmpl-{i:032x}" for i in range(20)]
    assert all(first.draw(i) != second.draw(i) for i in ids)
    # The same secret and id give the same seed, in any order and from any instance: no stream to locate.
    assert [first.draw(i) for i in reversed(ids)] == [SeedSource("secret-a").draw(i) for i in reversed(ids)]
    assert first.draw(ids[0]) == first.draw(ids[0])
    # Not a counter: drawing for other ids in between changes nothing.
    before = first.draw(ids[5])
    for i in range(100):
        first.draw(f"other-{i}")
    assert first.draw(ids[5]) == before
