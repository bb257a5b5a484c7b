"""An upload holding save_pretrained's README.md is accepted: the file is dropped, not stored (the
store's listing holds only the config and weights), and the version is the one the same upload without
it gets (api/tenant_adapters/uploads.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.servers import Server
from tests.harness.uploads import files_of, peft_adapter, upload

pytestmark = pytest.mark.slow  # a real server


def test_upload_with_readme_is_accepted_and_readme_not_stored(server: Server, tmp_path: Path) -> None:
    _, key = server.tenant("readme")
    files = files_of(peft_adapter(tmp_path / "a"))
    readme = b"---\nlibrary_name: peft\n---\n# Model card\n"
    r = upload(server, key, "carded", {**files, "README.md": readme})
    assert r.status_code == 201, r.text
    same = upload(server, key, "carded", files)  # byte-identical adapter: the same version
    assert (same.status_code, same.json()["version"]) == (200, r.json()["version"]), same.text
    assert not [k for k in server.store_keys() if k.endswith("README.md")]
