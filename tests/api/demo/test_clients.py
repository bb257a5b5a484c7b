"""Real client libraries against `loraserve serve` on the default model (SmolLM2-135M-Instruct, whose chat
template renders no tools), max_tokens 256: LangChain (`with_structured_output`, `bind_tools` with a forced
`tool_choice`, `use_responses_api=True`), LiteLLM's pydantic `response_format`, and the OpenAI Agents SDK
(its default model, `OpenAIResponsesModel`; `function_tool` with `tool_choice="required"`; a stored
conversation continued by `previous_response_id`). Structured
calls must finish (no `length`) and parse: compact JSON, and forced calls by grammar.

instructor is in test_instructor.py (skipped where it is not installed: its pins conflict with ours).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import BaseModel

from api.checkpoints.sources import SMOLLM2
from tests.harness.servers import ServerProcess

pytestmark = pytest.mark.slow  # a real server on the default model

MODEL = SMOLLM2.served_name
MAX_TOKENS = 256


class City(BaseModel):
    name: str
    country: str


class Weather(BaseModel):
    """Get the weather in a city."""

    city: str


@pytest.fixture(scope="module")
def served(
    smollm2_dir: Path, models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    env = {"LORASERVE_MODELS_DIR": str(models_dir)}
    args = ["--max-model-len", "2048", "--num-kv-blocks", "1024", "--max-num-seqs", "8"]
    process = ServerProcess(args, tmp_path_factory.mktemp("clients") / "data", env=env).start(timeout_s=300)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def key(served: ServerProcess) -> str:
    return (served.data_dir / "demo-tenant.key").read_text().strip()


def test_forced_tool_call_says_system_prompt_in_a_header(served: ServerProcess, key: str) -> None:
    tool = {"type": "function", "function": {"name": "Weather", "parameters": Weather.model_json_schema()}}
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [tool],
        "tool_choice": "required",
        "max_tokens": MAX_TOKENS,
    }
    url, auth = f"{served.base_url}/v1/chat/completions", {"Authorization": f"Bearer {key}"}
    r = httpx.post(url, json=body, headers=auth, timeout=300)
    assert r.status_code == 200, r.text
    assert r.headers["X-Loraserve-Tools"] == "system-prompt"
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    Weather.model_validate_json(choice["message"]["tool_calls"][0]["function"]["arguments"])
    auto = httpx.post(url, json={**body, "tool_choice": "auto"}, headers=auth, timeout=300)
    assert auto.status_code == 400 and "does not render tools" in auto.text


def test_langchain_structured_output_and_forced_tools(served: ServerProcess, key: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{served.base_url}/v1", api_key=key, max_tokens=MAX_TOKENS)
    city = llm.with_structured_output(City).invoke("Name a city in France, as JSON.")
    assert isinstance(city, City)
    message = llm.bind_tools([Weather], tool_choice="Weather").invoke("What is the weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "Weather"
    Weather.model_validate(message.tool_calls[0]["args"])
    required = llm.bind_tools([Weather], tool_choice="required").invoke("What is the weather in Rome?")
    assert required.tool_calls and required.response_metadata["finish_reason"] == "tool_calls"


def test_langchain_responses_api(served: ServerProcess, key: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL, base_url=f"{served.base_url}/v1", api_key=key, max_tokens=32, use_responses_api=True
    )
    message = llm.invoke("What is the capital of France?")
    assert message.text and message.usage_metadata["output_tokens"] > 0


def test_litellm_pydantic_response_format(served: ServerProcess, key: str) -> None:
    import os

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of its price list
    import litellm

    response = litellm.completion(
        model=f"openai/{MODEL}",
        api_base=f"{served.base_url}/v1",
        api_key=key,
        messages=[{"role": "user", "content": "Name a city in France, as JSON."}],
        response_format=City,
        max_tokens=MAX_TOKENS,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice
    City.model_validate_json(choice.message.content)


def test_agents_sdk_default_model_with_a_required_function_tool(served: ServerProcess, key: str) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # nothing leaves this machine
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the weather in a city."""
        seen.append(city)
        return f"sunny in {city}"

    client = AsyncOpenAI(base_url=f"{served.base_url}/v1", api_key=key, max_retries=0)
    model = OpenAIResponsesModel(model=MODEL, openai_client=client)
    # greedy: sampled at the default temperature 1 the 135M model now and then ran past max_tokens
    # (response.incomplete, which the SDK raises), one run in a full suite
    settings = ModelSettings(tool_choice="required", max_tokens=MAX_TOKENS, temperature=0.0)
    agent = Agent(
        name="weather",
        instructions="Answer with the tool.",
        tools=[get_weather],
        model=model,
        model_settings=settings,
        tool_use_behavior="stop_on_first_tool",  # "required" again after the call would never end
    )
    plain = Agent(
        name="plain",
        instructions="Be brief.",
        model=model,
        model_settings=ModelSettings(max_tokens=48, temperature=0.0),
    )

    async def both():  # one event loop: the client's connections belong to it
        return await Runner.run(agent, "What is the weather in Paris?"), await Runner.run(plain, "Say hello.")

    result, answer = asyncio.run(both())
    assert len(seen) == 1 and result.final_output == f"sunny in {seen[0]}", (seen, result.raw_responses)
    assert isinstance(answer.final_output, str) and answer.final_output


def test_agents_sdk_continues_a_stored_conversation(served: ServerProcess, key: str) -> None:
    """The Agents SDK's server-side conversation: `store=True` and `Runner.run(previous_response_id=)`
    (api/inference/stored_responses.py); the second turn's prompt holds the first turn."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{served.base_url}/v1", api_key=key, max_retries=0)
    agent = Agent(
        name="plain",
        instructions="Be brief.",
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(max_tokens=48, temperature=0.0, store=True),
    )

    async def two_turns():  # noqa: ANN202 - the SDK's RunResults
        first = await Runner.run(agent, "My name is Ada.")
        return first, await Runner.run(agent, "What is my name?", previous_response_id=first.last_response_id)

    first, second = asyncio.run(two_turns())
    assert isinstance(second.final_output, str) and second.final_output
    headers = {"Authorization": f"Bearer {key}"}
    kept = httpx.get(f"{served.base_url}/v1/responses/{second.last_response_id}", headers=headers, timeout=30)
    assert kept.status_code == 200 and kept.json()["previous_response_id"] == first.last_response_id
    (u1,), (u2,) = [r.usage for r in first.raw_responses], [r.usage for r in second.raw_responses]
    assert u2.input_tokens > u1.input_tokens + u1.output_tokens  # the first turn came before the second
