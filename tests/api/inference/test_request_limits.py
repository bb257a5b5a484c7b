"""What one request may ask of the shared engine (api/inference/limits.py, issue 28 items 8 and 9): fan-out
(n x prompts), stops and logprob entries past their settings are a 400 naming the limit, before any
engine work; at the limit the request runs. In process on the real app, with the limits lowered by
their settings (the defaults are checked against the issue)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.bootstrap import build_state
from api.settings import Settings

ADMIN = "lsa-limits-test-admin-key"
BASE = "tiny-llama"


@pytest.fixture(scope="module")
def client(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = Settings(
        model=tiny_llama_dir, served_model_name=BASE, data_dir=tmp_path_factory.mktemp("limits") / "data",
        admin_key=ADMIN, max_model_len=256, num_kv_blocks=64, max_num_seqs=8,
        max_choices_per_request=4, max_logprob_entries_per_response=120, max_stop_strings=3,
        max_stop_string_chars=5, max_stop_token_ids=4,
    )  # fmt: skip
    with TestClient(create_app(build_state(settings)), base_url="http://127.0.0.1:8000") as client:
        yield client


@pytest.fixture(scope="module")
def headers(client: TestClient) -> dict[str, str]:
    r = client.post(
        "/admin/api/tenants",
        json={"name": f"limits-{uuid.uuid4().hex[:8]}"},
        headers={"Authorization": f"Bearer {ADMIN}"},
    )
    assert r.status_code == 201, r.text
    return {"Authorization": f"Bearer {r.json()['api_key']}"}


def test_defaults_follow_the_issue() -> None:
    fields = Settings.model_fields
    assert fields["max_choices_per_request"].default == 16
    assert (fields["max_stop_strings"].default, fields["max_stop_string_chars"].default) == (16, 256)
    assert fields["max_stop_token_ids"].default == 256


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "path,body,param,message",
    [
        ("/v1/completions", {"prompt": "x", "n": 5}, "n", "5 choices (n=5); at most 4 (n x prompts)"),
        ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2}, "n", "6 choices (n=2 x 3 prompts)"),
        ("/v1/chat/completions", {**CHAT, "n": 5}, "n", "at most 4"),
        ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d"]}, "stop", "4 strings; at most 3"),
        ("/v1/chat/completions", {**CHAT, "stop": "abcdef"}, "stop", "6 characters long; at most 5"),
        (
            "/v1/completions",
            {"prompt": "x", "stop_token_ids": [1, 2, 3, 4, 5]},
            "stop_token_ids",
            "at most 4",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "n": 2, "max_tokens": 11, "logprobs": 5},
            "logprobs",
            "132 logprob entries (max_tokens 22 over all choices x 6 per token); at most 120",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "max_tokens": 121, "logprobs": True},
            "top_logprobs",
            "121 logprob entries (max_tokens 121 over all choices x 1 per token)",
        ),
    ],
)
def test_past_a_limit_is_400_naming_it(
    client: TestClient, headers: dict[str, str], path: str, body: dict[str, Any], param: str, message: str
) -> None:
    r = client.post(path, json={"model": BASE, **body}, headers=headers)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_value", error
    assert message in error["message"], error


def test_at_the_limits_the_request_runs(client: TestClient, headers: dict[str, str]) -> None:
    body = {
        "model": BASE, "prompt": ["a", "b"], "n": 2, "max_tokens": 4, "logprobs": 6, "temperature": 0,
        "stop": ["zzzzz", "yyy", "q"], "stop_token_ids": [1, 2, 3, 4],
    }  # fmt: skip
    r = client.post("/v1/completions", json=body, headers=headers)  # 4 choices x 4 tokens x 7 = 112 entries
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4
