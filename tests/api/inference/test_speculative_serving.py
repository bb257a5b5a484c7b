"""Speculative decoding as a served feature: a real server started with `--speculative ngram` answers
the same tokens as one without it, greedy and seeded at temperature 1, on completions and chat, through
the official `openai` client; `speculative: false` opts a request out, anything but a boolean is a 400
naming the field; usage counts the generated tokens only (never the rejected drafts)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.harness.engine_inputs import random_prompts
from tests.harness.families import CHECKPOINTS
from tests.harness.servers import Server, bearer, launch_server, main_server_args

pytestmark = pytest.mark.slow  # real servers

MODEL = "tiny-llama"
MAX_NEW = 32


@pytest.fixture(scope="module")
def model_dir(make_checkpoint) -> Path:
    # tied embeddings: its greedy output repeats itself more than an untied random model's (drafts accepted)
    return make_checkpoint(**CHECKPOINTS["llama-tied"])


@pytest.fixture(scope="module")
def plain(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with launch_server(main_server_args(model_dir), tmp_path_factory.mktemp("plain") / "data") as server:
        yield server


@pytest.fixture(scope="module")
def speculative(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = [*main_server_args(model_dir), "--speculative", "ngram", "--num-speculative-tokens", "3"]
    args += ["--speculative-off-batch", "0"]  # a tiny model's measured threshold is 1: speculation off
    with launch_server(args, tmp_path_factory.mktemp("spec") / "data") as server:
        yield server


def _client(server: Server) -> openai.OpenAI:
    key = server.tenant("spec")[1]
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=120)


def _completion(client: openai.OpenAI, prompt: list[int], **options: Any) -> tuple[list[int], Any]:
    extra = options.pop("extra_body", {})
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_NEW,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True, **extra},
        **options,
    )
    tokens = [int(t.split(":", 1)[1]) for t in r.choices[0].logprobs.tokens]
    return tokens, r.usage


def _spec_accepted(server: Server) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:spec_decode_num_accepted_tokens_total")
    )


def test_same_tokens_with_and_without_speculation(plain: Server, speculative: Server) -> None:
    a, b = _client(plain), _client(speculative)
    prompts = [p + p + p for p in random_prompts(3, 500, 6, 12, seed=21)]  # repeats: drafts
    cases: list[dict[str, Any]] = [
        {"temperature": 0.0},
        {"temperature": 1.0, "seed": 7},
        {"temperature": 1.0, "seed": 7, "extra_body": {"speculative": False}},
    ]
    for prompt in prompts:
        for case in cases:
            want, _ = _completion(a, prompt, **dict(case))
            got, usage = _completion(b, prompt, **dict(case))
            assert got == want, (case, prompt)
            # billed: the prompt and the generated tokens, never the drafts scored and rejected
            assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), MAX_NEW)
    assert _spec_accepted(speculative) > 0  # drafts were accepted: speculation ran


def test_chat_same_text_with_and_without_speculation(plain: Server, speculative: Server) -> None:
    passage = "the quick brown fox jumps over the lazy dog and " * 4
    messages = [{"role": "user", "content": f"Repeat the following text exactly: {passage}"}]
    texts = []
    for client in (_client(plain), _client(speculative)):
        r = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_NEW, temperature=1.0, seed=3
        )
        texts.append((r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens))
    assert texts[0] == texts[1]


@pytest.mark.parametrize("path", ["completions", "chat/completions", "responses"])
@pytest.mark.parametrize("value", ["no", 0, "false"])
def test_speculative_must_be_a_boolean(speculative: Server, path: str, value: Any) -> None:
    _, key = speculative.tenant("spec-bad")
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 1, "speculative": value}
    if path == "completions":
        body["prompt"] = "Hi"
    elif path == "chat/completions":
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body = {"model": MODEL, "input": "Hi", "max_output_tokens": 1, "speculative": value}
    r = httpx.post(f"{speculative.base_url}/v1/{path}", json=body, headers=bearer(key), timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "speculative" in (error.get("param") or "") + error["message"], r.text
