"""instructor against `loraserve serve` on the default model (SmolLM2-135M-Instruct, whose chat
template renders no tools), max_tokens 256, no re-asks: its JSON modes (`JSON`: `response_format`
json_object plus the schema in the prompt; `JSON_SCHEMA`: `response_format` json_schema) and `TOOLS`
mode (a forced named tool call) must finish and parse into the pydantic model. `JSON` (json_object)
does not on this model: see JSON_OBJECT_RUNS_LONG.

instructor is not in the dev extras: instructor 1.17.0 (the only release on the index) pins
`jiter<0.15` and `rich<15`, while openai 3.57 needs `jiter>=0.16` (and we have rich 15), so
installing it would downgrade openai to 3.3.0. It imports and runs with openai 3.57 / jiter 0.19 when
installed beside them without its pins: `make setup` does so (`pip install --no-deps
instructor==1.17.0 docstring_parser==0.18.0`, the Makefile's INSTRUCTOR), so `make test` runs this
module; elsewhere it is skipped where instructor is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from pydantic import BaseModel

from api.checkpoints.sources import SMOLLM2
from tests.harness.servers import ServerProcess

instructor = pytest.importorskip("instructor")
IncompleteOutputException = pytest.importorskip("instructor.core").IncompleteOutputException

pytestmark = pytest.mark.slow  # a real server on the default model

MODEL = SMOLLM2.served_name
MAX_TOKENS = 256


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def served(
    smollm2_dir: Path, models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    env = {"LORASERVE_MODELS_DIR": str(models_dir)}
    args = ["--max-model-len", "2048", "--num-kv-blocks", "1024", "--max-num-seqs", "8"]
    process = ServerProcess(args, tmp_path_factory.mktemp("instructor") / "data", env=env).start(
        timeout_s=300
    )
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def key(served: ServerProcess) -> str:
    return (served.data_dir / "demo-tenant.key").read_text().strip()


# Mode.JSON sends `response_format: json_object` with the schema only in the system prompt: any JSON
# object is valid, and SmolLM2-135M writes one whose key is a string that never ends (`{", ":true,"} The
# answer is France. ...`), so it runs into max_tokens (vLLM's json_object is the same constraint).
# Strict: when it starts to pass, this marker must go.
JSON_OBJECT_RUNS_LONG = pytest.mark.xfail(
    raises=IncompleteOutputException,
    strict=True,
    reason="json_object on the 135M model: a key string that never ends (max_tokens)",
)


@pytest.mark.parametrize("mode", [pytest.param("JSON", marks=JSON_OBJECT_RUNS_LONG), "JSON_SCHEMA", "TOOLS"])
def test_structured_call_finishes_and_parses(served: ServerProcess, key: str, mode: str) -> None:
    raw = openai.OpenAI(base_url=f"{served.base_url}/v1", api_key=key, max_retries=0, timeout=300)
    client = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))
    city, completion = client.chat.completions.create_with_completion(
        model=MODEL,
        response_model=City,
        messages=[{"role": "user", "content": "Which city is the capital of France?"}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        max_retries=0,  # no re-ask: the first answer must parse
    )
    assert isinstance(city, City) and city.name and city.country
    assert completion.choices[0].finish_reason in ("stop", "tool_calls")
    if mode == "TOOLS":
        assert completion.choices[0].message.tool_calls[0].function.name == "City"
