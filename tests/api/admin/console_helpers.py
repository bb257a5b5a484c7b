"""Shared set-up of the in-process console tests: the real app on a tiny model, cookie-jar clients.

`console_app` builds the real app (`build_state` + `create_app`: engine, SQLite registry,
LocalStore), once per test module; `browser(app)` is a TestClient with its own cookie jar that follows no
redirects, so tests see them.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.app import create_app
from api.bootstrap import build_state
from api.settings import Settings
from api.state import AppState

ADMIN = "lsa-console-test-admin-key"
BASE_URL = "http://127.0.0.1:8000"


@contextmanager
def console_app(model_dir: Path, tmp: Path) -> Iterator[tuple[FastAPI, AppState]]:
    """The real app on `model_dir` with its data in `tmp`, engine running while the block lasts."""
    settings = Settings(
        model=model_dir,
        served_model_name="tiny-llama",
        data_dir=tmp / "data",
        admin_key=ADMIN,
        max_model_len=256,
        num_kv_blocks=128,
        max_num_seqs=8,
        max_loras=2,
        max_cpu_loras=4,
        max_lora_rank=16,
    )
    state = build_state(settings)
    app = create_app(state)
    with TestClient(app, base_url=BASE_URL):  # runs the lifespan: the engine thread
        yield app, state


def browser(app: FastAPI) -> TestClient:
    """A client with its own cookie jar that follows no redirects (tests look at them)."""
    return TestClient(app, base_url=BASE_URL, follow_redirects=False)


def admin_api(app: FastAPI, method: str, path: str, **kwargs: Any) -> Any:
    r = browser(app).request(
        method, f"/admin/api{path}", headers={"Authorization": f"Bearer {ADMIN}"}, **kwargs
    )
    assert r.status_code < 300, r.text
    return r.json()


def login(client: TestClient) -> str:
    """Sign in; returns the session's CSRF token as the pages carry it."""
    r = client.post("/admin/login", data={"admin_key": ADMIN, "next": "/admin"})
    assert r.status_code == 303, r.text
    return csrf_of(client.get("/admin/tenants").text)


def csrf_of(page: str) -> str:
    match = re.search(r'<meta name="csrf-token" content="([^"]+)">', page)
    assert match, page[:500]
    return match.group(1)


def new_tenant_name() -> str:
    return f"c-{uuid.uuid4().hex[:8]}"


def tenant_key_works(app: FastAPI, key: str) -> bool:
    r = browser(app).get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code in (200, 401), r.text
    return r.status_code == 200


def create_tenant(client: TestClient, csrf: str, name: str) -> tuple[str, str]:
    """(tenant id, api key) through the console form."""
    page = client.post("/admin/tenants", data={"name": name, "csrf_token": csrf})
    assert page.status_code == 200, page.text
    key = re.search(r'<code id="new-api-key">([^<]+)</code>', page.text)
    tenant_id = re.search(r'href="/admin/tenants/([0-9a-f]+)"', page.text)
    assert key and tenant_id, page.text
    return tenant_id.group(1), key.group(1)


def peft_adapter(model_dir: Path, out: Path, *, rank: int) -> Path:
    """A LoRA adapter for `model_dir` saved by peft itself (random B, so it changes outputs)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    get_peft_model(model, config).save_pretrained(str(out))
    return out
