"""Response fields beside `vllm serve`, through a real server and the official `openai` client:
`stop_reason` (the stop string or stop token id that ended a choice), `stream_options.continuous_usage_stats`
(every chunk carries the usage so far, billed once), `echo` on /v1/completions and `prompt_logprobs`
(with `echo` + `logprobs`: OpenAI's legacy layout), the logprobs against transformers in fp32."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.harness.engine_inputs import random_prompts
from tests.harness.servers import Server, bearer, launch_server, main_server_args
from tests.harness.usage import export
from tests.harness.wait import wait_for

pytestmark = pytest.mark.slow  # a real server

MODEL = "tiny-llama"
MAX_NEW = 8


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with launch_server(
        main_server_args(tiny_llama_dir), tmp_path_factory.mktemp("fields") / "data"
    ) as started:
        yield started


@pytest.fixture(scope="module")
def tenant(server: Server) -> tuple[str, str]:
    return server.tenant("fields")


@pytest.fixture(scope="module")
def client(server: Server, tenant: tuple[str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=tenant[1], max_retries=0, timeout=120)


def _greedy(client: openai.OpenAI, prompt: list[int], **extra) -> tuple[list[int], str]:
    """Generated ids (via `return_tokens_as_token_ids`) and text of a greedy, EOS-ignoring completion."""
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_NEW,
        temperature=0.0,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True, **extra},
    )
    return [int(t.split(":", 1)[1]) for t in r.choices[0].logprobs.tokens], r.choices[0].text


def _stream_chunks(client: openai.OpenAI, **kwargs) -> list:
    create = client.chat.completions.create if "messages" in kwargs else client.completions.create
    return list(create(model=MODEL, stream=True, temperature=0.0, **kwargs))


# -- stop_reason ----------------------------------------------------------------------------------


def test_stop_reason_is_the_stop_token_id_or_string(client) -> None:
    prompt = random_prompts(1, 500, 6, 6, seed=11)[0]
    ids, text = _greedy(client, prompt)
    stop_id = ids[3]
    base = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0.0}
    by_id = client.completions.create(**base, extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert by_id.choices[0].finish_reason == "stop"
    assert by_id.choices[0].stop_reason == stop_id  # an int, as vLLM
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), text
    by_string = client.completions.create(**base, stop=[stop], extra_body={"ignore_eos": True})
    assert by_string.choices[0].finish_reason == "stop" and by_string.choices[0].stop_reason == stop
    length = client.completions.create(**base, extra_body={"ignore_eos": True})
    assert length.choices[0].finish_reason == "length" and length.choices[0].stop_reason is None

    chunks = _stream_chunks(
        client, prompt=prompt, max_tokens=MAX_NEW, extra_body={"stop_token_ids": [stop_id]}
    )
    ends = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(ends) == 1 and ends[0].stop_reason == stop_id
    assert all(
        c.choices[0].stop_reason is None for c in chunks if c.choices and not c.choices[0].finish_reason
    )


def test_chat_stop_reason(client) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_NEW, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert plain.choices[0].stop_reason is None and plain.choices[0].finish_reason == "length"
    content = plain.choices[0].message.content
    stop = content[len(content) // 2 :][:2]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_NEW, temperature=0.0, stop=stop,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and r.choices[0].stop_reason == stop
    chunks = _stream_chunks(
        client, messages=messages, max_tokens=MAX_NEW, stop=stop, extra_body={"ignore_eos": True}
    )
    assert [c.choices[0].stop_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [stop]


# -- stream_options.continuous_usage_stats -------------------------------------------------------


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_continuous_usage_counts_every_chunk_and_bills_once(client, server, tenant, kind) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    if kind == "chat":
        request = {"messages": [{"role": "user", "content": "Count to ten."}]}
    else:
        request = {"prompt": "Count to ten:"}
    plain = _stream_chunks(client, **request, max_tokens=MAX_NEW, n=2, stream_options={"include_usage": True})
    chunks = _stream_chunks(
        client, **request, max_tokens=MAX_NEW, n=2, stream_options=options, extra_body={"ignore_eos": True}
    )
    *content, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 2 * MAX_NEW  # the final usage chunk
    assert all(c.usage is None for c in plain[:-1])  # without the option: null but on the last chunk
    assert all(c.usage is not None for c in content)
    counts = [c.usage.completion_tokens for c in content]
    assert counts == sorted(counts) and counts[-1] == last.usage.completion_tokens  # so far, growing
    if kind == "chat":
        assert counts[:2] == [0, 0]  # the role chunks come before any token
    for c in content:
        assert c.usage.prompt_tokens == last.usage.prompt_tokens
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    num_texts = 0
    for c, count in zip(content, counts, strict=True):
        num_texts += bool(
            c.choices and (c.choices[0].text if kind == "completion" else c.choices[0].delta.content)
        )
        assert count >= num_texts  # a chunk counts the tokens it carries
    record = wait_for(
        lambda: next((r for r in export(server.base_url, tenant[0]) if r["request_id"] == last.id), None),
        timeout=30,
    )
    assert record["completion_tokens"] == last.usage.completion_tokens  # billed once, as streamed
    assert record["prompt_tokens"] == last.usage.prompt_tokens


def test_continuous_usage_without_include_usage_is_refused_by_name(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _stream_chunks(client, prompt="hi", max_tokens=2, stream_options={"continuous_usage_stats": True})
    assert info.value.body["param"] == "stream_options.continuous_usage_stats"


# -- echo ------------------------------------------------------------------------------------------


def test_echo_prepends_the_prompt(client, tiny_llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    text_prompt = "The capital of France is"
    ids_prompt = random_prompts(1, 500, 5, 5, seed=12)[0]
    for prompt, echoed in [(text_prompt, text_prompt), (ids_prompt, tokenizer.decode(ids_prompt))]:
        base = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0.0, "n": 2}
        plain = client.completions.create(**base)
        echo = client.completions.create(**base, echo=True)
        assert [c.text for c in echo.choices] == [echoed + c.text for c in plain.choices]
        assert echo.usage == plain.usage  # the prompt is not billed twice
        chunks = _stream_chunks(client, prompt=prompt, max_tokens=MAX_NEW, n=2, echo=True)
        for index in range(2):
            pieces = [c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index]
            assert pieces[0].startswith(echoed) and "".join(pieces) == echo.choices[index].text
    truncated = client.completions.create(
        model=MODEL, prompt=ids_prompt, max_tokens=2, temperature=0.0, echo=True,
        extra_body={"truncate_prompt_tokens": 3},
    )  # fmt: skip
    assert truncated.choices[0].text.startswith(tokenizer.decode(ids_prompt[-3:]))


# -- prompt_logprobs and echo with logprobs: against transformers' log_softmax over the prompt -----

ATOL = 1e-3  # the engine's logprob tolerance against transformers (tests/base_engine/oracle.py)


@pytest.fixture(scope="module")
def prompt_reference(tiny_llama_dir: Path):
    hf = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()

    def reference(prompt: list[int]) -> torch.Tensor:
        """[len(prompt) - 1, vocab]: row p scores prompt token p + 1."""
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)[:-1]

    return reference


def _check_vllm_layout(entries: list, prompt: list[int], ref: torch.Tensor, num_top: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for p, row in enumerate(entries[1:]):
        token = prompt[p + 1]
        assert next(iter(row)) == str(token)  # the prompt token's own entry first
        assert abs(row[str(token)]["logprob"] - ref[p, token].item()) <= ATOL
        assert abs(row[str(token)]["rank"] - (int((ref[p] > ref[p, token]).sum()) + 1)) <= 1  # near-ties
        assert row[str(token)]["decoded_token"] == f"token_id:{token}"
        alternatives = [int(t) for t in row if int(t) != token]
        assert len(alternatives) in (num_top - 1, num_top)
        kth = ref[p].topk(num_top).values[-1].item()
        for t in alternatives:
            assert abs(row[str(t)]["logprob"] - ref[p, t].item()) <= ATOL and ref[p, t].item() >= kth - ATOL


def test_prompt_logprobs_match_transformers(client, server, tenant, prompt_reference) -> None:
    prompt = random_prompts(1, 500, 12, 12, seed=13)[0]
    extra = {"prompt_logprobs": 3, "return_tokens_as_token_ids": True}
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=2, extra_body=extra)
    ref = prompt_reference(prompt)
    for choice in r.choices:
        _check_vllm_layout(choice.prompt_logprobs, prompt, ref, 3)
    messages = [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=extra)
    rendered = httpx.post(
        f"{server.base_url}/tokenize", json={"model": MODEL, "messages": messages}, headers=bearer(tenant[1])
    ).json()["tokens"]  # vLLM's /tokenize: the prompt the chat ran
    assert len(chat.prompt_logprobs) == chat.usage.prompt_tokens == len(rendered)
    _check_vllm_layout(chat.prompt_logprobs, rendered, prompt_reference(rendered), 3)


def test_prompt_logprobs_with_stream_are_refused_by_name(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _stream_chunks(client, prompt="hi", max_tokens=2, extra_body={"prompt_logprobs": 1})
    assert info.value.body["param"] == "prompt_logprobs"


def test_echo_with_logprobs_puts_the_prompt_tokens_first(client, prompt_reference) -> None:
    prompt = random_prompts(1, 500, 9, 9, seed=14)[0]
    base = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0.0, "logprobs": 2}
    extra = {"return_tokens_as_token_ids": True}
    plain = client.completions.create(**base, extra_body=extra).choices[0]
    echo = client.completions.create(**base, echo=True, extra_body=extra).choices[0]
    lp, ref = echo.logprobs, prompt_reference(prompt)
    assert lp.tokens == [f"token_id:{t}" for t in prompt] + plain.logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # OpenAI's layout
    for p in range(1, len(prompt)):
        assert abs(lp.token_logprobs[p] - ref[p - 1, prompt[p]].item()) <= ATOL
        assert len(lp.top_logprobs[p]) == 2
    assert lp.token_logprobs[len(prompt) :] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    echoed = echo.text[: len(echo.text) - len(plain.text)]
    assert lp.text_offset[len(prompt)] == len(echoed)  # the generated text starts after the prompt's
    assert lp.text_offset == sorted(lp.text_offset)
    chunks = _stream_chunks(client, prompt=prompt, max_tokens=4, logprobs=2, echo=True, extra_body=extra)
    streamed = [
        t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens
    ]
    assert streamed == lp.tokens


# -- spaces_between_special_tokens (the detokenizer's rule: tests/base_engine/test_special_tokens_text.py) --


def test_spaces_between_special_tokens_reaches_the_detokenizer(client, tiny_llama_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    specials = [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens]
    base = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "temperature": 0.0}
    extra = {"allowed_token_ids": specials, "skip_special_tokens": False, "ignore_eos": True}
    texts = [
        client.completions.create(**base, extra_body={**extra, "spaces_between_special_tokens": spaces})
        .choices[0]
        .text
        for spaces in (True, False)
    ]
    assert texts[0] == texts[1] and any(
        t in texts[0] for t in tokenizer.all_special_tokens
    )  # byte-level: no spaces
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**base, extra_body={"spaces_between_special_tokens": "yes"})
    assert info.value.body["param"] == "spaces_between_special_tokens"
