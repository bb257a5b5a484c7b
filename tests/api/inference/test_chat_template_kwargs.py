"""`chat_template_kwargs` (vLLM's request field) through a real server and the official `openai` client
(`extra_body`), on a tiny Qwen3 whose template reads `enable_thinking`: the prompt is what transformers
renders with the same variables, on /v1/chat/completions and /tokenize; bad values are 400s naming it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.harness.families import CHECKPOINTS
from tests.harness.servers import Server, launch_server, main_server_args

pytestmark = pytest.mark.slow  # a real server

MODEL = "tiny-llama"  # main_server_args' served name
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
DEEP: list = [1]
for _ in range(20):
    DEEP = [DEEP]


@pytest.fixture(scope="module")
def qwen3_dir(make_checkpoint) -> Path:
    return make_checkpoint(**CHECKPOINTS["qwen3"])


@pytest.fixture(scope="module")
def served(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, str]]:
    with launch_server(main_server_args(qwen3_dir), tmp_path_factory.mktemp("kwargs") / "data") as server:
        yield server, server.tenant("kwargs")[1]


def _client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_enable_thinking_reaches_the_template(served, qwen3_dir: Path, enable_thinking: bool) -> None:
    server, key = served
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    rendered = tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    assert rendered.endswith("<think>\n\n</think>\n\n") == (not enable_thinking)
    client = _client(server, key)
    kwargs = {"chat_template_kwargs": {"enable_thinking": enable_thinking}}
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0.0, extra_body=kwargs
    )
    # Oracle: the completion of transformers' rendering (its tokens: the template writes any BOS itself).
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    completion = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0.0)
    assert chat.usage.prompt_tokens == completion.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == completion.choices[0].text
    r = httpx.post(
        f"{server.base_url}/tokenize",
        json={"model": MODEL, "messages": MESSAGES, **kwargs},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["count"] == chat.usage.prompt_tokens, r.text


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("enable_thinking", r"valid dictionary"),
        ({"add_generation_prompt": False}, r"'add_generation_prompt' would replace"),
        ({"tools": []}, r"'tools' would replace"),
        ({"not a name": True}, r"is not a name"),
        ({"deep": DEEP}, r"nests deeper than the limit of 16"),
    ],
)
def test_bad_value_is_a_400_naming_the_field(served, value, message: str) -> None:
    server, key = served
    with pytest.raises(openai.BadRequestError, match=message) as excinfo:
        _client(server, key).chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=1, extra_body={"chat_template_kwargs": value}
        )
    assert excinfo.value.body["param"] == "chat_template_kwargs", excinfo.value.body
