"""API details against a real server (SQLite + local store), with the official `openai`
client and httpx: partial-UTF-8 logprobs, `max_completion_tokens`, `user` in the usage record,
`/tokenize` and `/detokenize`, adapter names vs the base model, identical re-uploads, and the
series vLLM's Grafana dashboard reads on `/metrics`."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from api.inference.formatting import token_bytes
from base_engine.model.tokenizer import load_tokenizer
from tests.harness.servers import Server
from tests.harness.uploads import files_of, peft_adapter, upload
from tests.harness.wait import wait_for

BASE = "tiny-llama"
SERIES_FILE = Path(__file__).with_name("vllm_grafana_series.txt")
SQLITE = pytest.mark.parametrize("server", ["sqlite-local"], indirect=True)  # one backend suffices


@pytest.fixture
def tenant(server: Server) -> tuple[str, str]:
    return server.tenant("details")


def _client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=120)


def _post(server: Server, key: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )


@pytest.mark.slow
@SQLITE
def test_partial_utf8_logprobs_carry_real_bytes(server: Server, tenant, tiny_llama_dir: Path) -> None:
    client = _client(server, tenant[1])
    tokenizer = load_tokenizer(tiny_llama_dir)
    chat = client.chat.completions.create(
        model=BASE,
        messages=[{"role": "user", "content": "€ 😀 ü"}],
        max_tokens=24,
        temperature=1.0,
        seed=3,
        logprobs=True,
        top_logprobs=20,
    )
    content = chat.choices[0].logprobs.content
    joined = b"".join(bytes(t.bytes) for t in content)
    # The oracle: the tokens' bytes, concatenated, are the text (OpenAI's documented property).
    assert joined.decode("utf-8", "replace") == chat.choices[0].message.content
    partial = 0
    for entry in [*content, *(top for t in content for top in t.top_logprobs)]:
        if entry.token.startswith("bytes:"):
            partial += 1
            assert bytes(entry.bytes).hex() == entry.token.removeprefix("bytes:").replace("\\x", "")
        assert entry.bytes != list("\ufffd".encode())
    assert partial > 0, "the tiny vocabulary has 128 lone-byte tokens; 20 alternatives x 24 steps hit some"

    comp = client.completions.create(model=BASE, prompt="€ 😀", max_tokens=16, logprobs=20, seed=5)
    lp = comp.choices[0].logprobs
    for top in lp.top_logprobs:
        assert len(top) == 20, "tokens decoding to the same U+FFFD must not share one key"
    ids = {t: i for i in range(len(tokenizer)) for t in [tokenizer.decode([i])] if "\ufffd" not in t}
    for token in lp.tokens:
        if token in ids:
            assert token_bytes(tokenizer, ids[token], True).decode() == token


@pytest.mark.slow
@SQLITE
def test_max_completion_tokens_wins_over_max_tokens(server: Server, tenant) -> None:
    client = _client(server, tenant[1])
    chat = client.chat.completions.create(
        model=BASE,
        messages=[{"role": "user", "content": "count"}],
        max_tokens=9,
        max_completion_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage.completion_tokens == 3
    chat = client.chat.completions.create(
        model=BASE,
        messages=[{"role": "user", "content": "count"}],
        max_tokens=4,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage.completion_tokens == 4


@pytest.mark.slow
@SQLITE
def test_user_is_recorded_with_the_usage_record(server: Server, tenant) -> None:
    tenant_id, key = tenant
    chat = _client(server, key).chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=2, user="end-user-42"
    )

    def exported() -> dict[str, dict]:
        r = server.admin("GET", "/usage/export", params={"tenant_id": tenant_id, "limit": 100})
        assert r.status_code == 200, r.text
        return {e["id"]: e["data"] for e in map(json.loads, r.text.splitlines())}

    records = wait_for(lambda: (found := exported()) and chat.id in found and found, 30, interval=0.2)
    assert records[chat.id]["user"] == "end-user-42"
    too_long = _post(server, key, "/v1/completions", {"model": BASE, "prompt": "x", "user": "u" * 300})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "user", too_long.text


@pytest.mark.slow
@SQLITE
def test_tokenize_and_detokenize_as_vllm(
    server: Server, tenant, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    _, key = tenant
    tokenizer = load_tokenizer(tiny_llama_dir)
    r = _post(
        server, key, "/tokenize", {"model": BASE, "prompt": "The quick brown fox", "return_token_strs": True}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    expected = tokenizer.encode("The quick brown fox", add_special_tokens=True)
    assert body["tokens"] == expected and body["count"] == len(expected) and body["max_model_len"] > 0
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    r = _post(server, key, "/detokenize", {"model": BASE, "tokens": expected})
    assert r.status_code == 200 and r.json()["prompt"] == tokenizer.decode(expected), r.text

    messages = [{"role": "user", "content": "hello"}]
    chat = _post(server, key, "/tokenize", {"model": BASE, "messages": messages})
    assert chat.status_code == 200, chat.text
    completion = _client(server, key).chat.completions.create(model=BASE, messages=messages, max_tokens=1)
    assert chat.json()["count"] == completion.usage.prompt_tokens  # the same rendering as chat

    assert upload(server, key, "tok-bot", files_of(peft_adapter(tmp_path / "a"))).status_code == 201
    assert _post(server, key, "/tokenize", {"model": "tok-bot", "prompt": "x"}).json()["tokens"] == (
        tokenizer.encode("x", add_special_tokens=True)
    )
    other = server.tenant("details-other")[1]
    for path, extra in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        refused = _post(server, other, path, {"model": "tok-bot", **extra})  # not theirs: unknown
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
        anonymous = httpx.post(f"{server.base_url}{path}", json={"model": BASE, **extra}, timeout=30)
        assert anonymous.status_code == 401
    bad = _post(server, key, "/detokenize", {"model": BASE, "tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_message_name_reaches_the_chat_template(tiny_llama_dir: Path) -> None:
    """The template sees `name` (the served tiny template ignores it, so this renders with one that
    prints it, through the same function the chat endpoint and /tokenize use)."""
    from api.inference.protocol import ChatCompletionRequest
    from api.inference.tools import template_messages

    body = ChatCompletionRequest(
        model=BASE,
        messages=[{"role": "user", "content": "hi", "name": "alice"}, {"role": "user", "content": "x"}],
    )
    tokenizer = load_tokenizer(tiny_llama_dir)
    tokenizer.chat_template = "{% for m in messages %}[{{ m.name or '-' }}] {{ m.content }}\n{% endfor %}"
    from base_engine.model.tokenizer import render_chat

    assert (
        render_chat(tokenizer, template_messages(body, None), add_generation_prompt=False)
        == "[alice] hi\n[-] x\n"
    )


@pytest.mark.slow
@SQLITE
def test_adapter_named_after_the_base_model_is_refused(server: Server, tenant, tmp_path: Path) -> None:
    _, key = tenant
    r = upload(server, key, BASE, files_of(peft_adapter(tmp_path / "a")))
    assert r.status_code == 409, r.text
    assert BASE in r.json()["error"]["message"] and "base model" in r.json()["error"]["message"]
    ids = [m.id for m in _client(server, key).models.list().data]
    assert ids.count(BASE) == 1


@pytest.mark.slow
@SQLITE
def test_identical_reupload_returns_the_existing_version(server: Server, tenant, tmp_path: Path) -> None:
    _, key = tenant
    files = files_of(peft_adapter(tmp_path / "a"))
    first = upload(server, key, "same-bot", files)
    assert first.status_code == 201, first.text
    again = upload(server, key, "same-bot", files)
    assert again.status_code == 200, again.text
    assert again.json()["version"] == first.json()["version"] == 1
    assert again.json()["sha256"] == first.json()["sha256"]
    changed = upload(server, key, "same-bot", files_of(peft_adapter(tmp_path / "b", seed=1)))
    assert changed.status_code == 201 and changed.json()["version"] == 2
    back = upload(server, key, "same-bot", files)  # identical to v1, not to the latest: a new version
    assert back.status_code == 201 and back.json()["version"] == 3


@pytest.mark.slow
@SQLITE
def test_every_series_of_vllms_grafana_dashboard_exists(server: Server, tenant) -> None:
    client = _client(server, tenant[1])
    client.completions.create(
        model=BASE, prompt="metrics", max_tokens=5, n=2, extra_body={"ignore_eos": True}
    )
    client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    wanted = [s for s in SERIES_FILE.read_text().splitlines() if s and not s.startswith("#")]
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    samples = {
        sample.name: sample for family in text_string_to_metric_families(text) for sample in family.samples
    }
    missing = [s for s in wanted if s not in samples]
    assert not missing, f"series a vLLM dashboard reads are missing: {missing}"
    assert not [name for name in samples if name.endswith("_created")]
    counts = {f: samples[f"vllm:{f}_count"].value for f in ("request_time_per_output_token_seconds",)}
    assert counts["request_time_per_output_token_seconds"] >= 3
    assert samples["vllm:request_max_num_generation_tokens_count"].value >= 2
    info = samples["vllm:cache_config_info"]
    assert info.value == 1 and int(info.labels["block_size"]) > 0 and int(info.labels["num_gpu_blocks"]) > 0
