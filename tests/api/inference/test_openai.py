"""The OpenAI endpoints through the official `openai` client (sync and async) against a real server.

Oracles: the OpenAI wire format as the client parses it, the tiny model's own tokenizer for token
counts, and the engine's determinism (same seed -> same text).
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.harness.servers import MAX_MODEL_LEN, Server

pytestmark = pytest.mark.slow  # real servers

BASE = "tiny-llama"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def key(server: Server) -> str:
    return server.tenant("oai")[1]


@pytest.fixture(scope="module")
def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=120)


def test_completion_usage_counts_prompt_tokens(client: openai.OpenAI, tiny_llama_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    raw = client.completions.with_raw_response.create(model=BASE, prompt=PROMPT, max_tokens=5, temperature=0)
    completion = raw.parse()
    assert raw.headers["x-request-id"] == completion.id and completion.id.startswith("cmpl-")
    assert completion.object == "text_completion" and completion.model == BASE
    assert completion.usage.prompt_tokens == len(tokenizer.encode(PROMPT))  # BOS + text
    assert completion.usage.completion_tokens == 5
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 5
    assert completion.usage.prompt_tokens_details.cached_tokens >= 0
    assert completion.choices[0].finish_reason == "length"


def test_chat_completion(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=BASE, messages=[{"role": "user", "content": "Hello!"}], max_completion_tokens=4, temperature=0
    )
    chat = raw.parse()
    assert raw.headers["x-request-id"] == chat.id and chat.id.startswith("chatcmpl-")
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant" and isinstance(chat.choices[0].message.content, str)
    assert chat.usage.completion_tokens == 4


def test_greedy_stream_equals_non_stream_and_reports_usage(client: openai.OpenAI) -> None:
    full = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=12, temperature=0)
    stream = client.completions.create(
        model=BASE,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_n2_include_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=BASE,
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=6,
        n=2,
        seed=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, reasons = {0: "", 1: ""}, {}
    usage = None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert reasons == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 12  # summed over both choices


def test_n2_choices_are_distinct_and_seed_reproducible(client: openai.OpenAI) -> None:
    def run() -> list[str]:
        out = client.completions.create(
            model=BASE, prompt=PROMPT, max_tokens=10, n=2, seed=1234, temperature=1.0
        )
        assert [c.index for c in out.choices] == [0, 1]
        assert out.usage.completion_tokens == 20
        return [c.text for c in out.choices]

    first = run()
    assert first == run()
    assert first[0] != first[1]  # derived seeds: the two choices do not repeat each other
    other = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=10, seed=99, temperature=1.0)
    assert other.choices[0].text != first[0]


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    free = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=20, temperature=0).choices[0].text
    stop = free[3:6]
    assert len(stop) == 3 and stop.strip()
    cut = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == free[: free.index(stop)]


def test_logprobs_shapes(client: openai.OpenAI) -> None:
    comp = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    assert all(len(top) == 2 for top in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    assert all(
        abs(max(top.values()) - chosen) < 1e-5
        for top, chosen in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )
    chat = client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.logprob <= 0 and e.bytes == _expected_bytes(e.token) for e in content)


def _expected_bytes(token: str) -> list[int]:
    """A token of whole UTF-8 characters: its text's bytes; a partial one is written `bytes:\\xe2..`."""
    if token.startswith("bytes:"):
        return list(bytes.fromhex(token[len("bytes:") :].replace("\\x", "")))
    return list(token.encode())


def test_async_client_concurrent_requests(server: Server, key: str) -> None:
    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
        calls = [
            client.completions.create(model=BASE, prompt=f"{PROMPT} {i}", max_tokens=4, temperature=0)
            for i in range(4)
        ]
        stream = await client.chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, stream=True
        )  # greedy: a sampled answer may draw EOS, and which drawn seed it gets depends on arrival order
        results = await asyncio.gather(*calls)
        chunks = [c async for c in stream]
        await client.close()
        return [r.choices[0].finish_reason for r in results] + [chunks[-1].choices[0].finish_reason]

    assert asyncio.run(main()) == ["length"] * 5


def test_models_lists_base_first(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert models[0].id == BASE


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"modalities": ["audio"]}, "modalities"),
        ({"logit_bias": {"one": 5}}, "logit_bias"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"temperature": 3.5}, "temperature"),
    ],
)
def test_chat_refuses_unsupported_fields_naming_them(client: openai.OpenAI, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body=extra
        )
    assert info.value.body["param"] == param and param in info.value.body["message"]


@pytest.mark.parametrize(("extra", "param"), [({"best_of": 3}, "best_of"), ({"suffix": "x"}, "suffix")])
def test_completions_refuse_unsupported_fields(client: openai.OpenAI, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=BASE, prompt="Hi", max_tokens=2, extra_body=extra)
    assert info.value.body["param"] == param


def test_context_length_is_checked_before_the_stream_starts(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=BASE, prompt=PROMPT, max_tokens=MAX_MODEL_LEN, stream=True)
    assert info.value.body["code"] == "context_length_exceeded"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=BASE, prompt="word " * MAX_MODEL_LEN, max_tokens=1)


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "Hi"}], extra_body={"ignore_eos": True}
    )
    usage = chat.usage
    assert usage.prompt_tokens + usage.completion_tokens == MAX_MODEL_LEN
    assert chat.choices[0].finish_reason == "length"


def test_unknown_model_is_404_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


def test_errors_are_openai_shaped(server: Server, key: str) -> None:
    auth = {"Authorization": f"Bearer {key}"}
    cases = [
        (httpx.get(f"{server.base_url}/v1/nope", headers=auth), 404),
        (
            httpx.post(
                f"{server.base_url}/v1/completions",
                headers={**auth, "content-type": "application/json"},
                content=b"{not json",
            ),
            400,
        ),  # fmt: skip
        (httpx.get(f"{server.base_url}/v1/models"), 401),
        (
            httpx.get(
                f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {server.admin_key}"}
            ),
            401,
        ),
        (httpx.get(f"{server.base_url}/admin/api/tenants", headers=auth), 401),
    ]
    for response, status in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_health_and_ready(server: Server) -> None:
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.base_url}/ready").json()["status"] == "ready"


def test_prompt_lists_and_token_ids(client: openai.OpenAI, tiny_llama_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=BASE, prompt=PROMPT, max_tokens=4, temperature=0)
    by_ids = client.completions.create(model=BASE, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=BASE, prompt=[PROMPT, "Hello"], max_tokens=3, n=2, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert (
        batch.choices[0].text
        == batch.choices[1].text
        == by_text.choices[0].text[: len(batch.choices[0].text)]
    )
    assert batch.usage.prompt_tokens == len(ids) + len(tokenizer.encode("Hello"))
    assert batch.usage.completion_tokens == 12
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=BASE, prompt=[10**6], max_tokens=2)
    assert info.value.body["param"] == "prompt"
