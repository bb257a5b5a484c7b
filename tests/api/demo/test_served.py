"""`loraserve serve` with no --model: SmolLM2-135M-Instruct and the demo tenant's trained adapters.

One server for the module (its models dir is the session's shared conversion). Greedy answers
through the HTTP API equal `transformers` (+ `peft` for the adapters) token for token, each
adapter's trait holds on >= 8 of the 10 held-out prompts (api/demo/traits.py), and the README's
example questions, asked of each demo adapter as the README does, repeat no 3-gram more than twice
(the adapters' own sampling defaults, api/demo/adapters/generation-defaults.json).
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from api.checkpoints.sources import SMOLLM2
from api.demo.tenant import DEMO_ADAPTERS_DIR, demo_generation_defaults
from api.demo.traits import HELD_OUT_PROMPTS, TRAITS
from tests.harness.servers import ServerProcess

pytestmark = pytest.mark.slow  # real servers

BASE = SMOLLM2.served_name
ORACLE_PROMPTS = ("What is the capital of France?", "Give me a tip for staying healthy.")
ORACLE_TOKENS = 24


@pytest.fixture(scope="module")
def served(
    smollm2_dir: Path, models_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    env = {"LORASERVE_MODELS_DIR": str(models_dir)}
    args = ["--max-model-len", "1024", "--num-kv-blocks", "1024", "--max-num-seqs", "32"]
    process = ServerProcess(args, tmp_path_factory.mktemp("smollm2") / "data", env=env).start(timeout_s=300)
    try:
        yield process
    finally:
        process.stop()


def _key(served: ServerProcess) -> str:
    return (served.data_dir / "demo-tenant.key").read_text().strip()


def _chat(served: ServerProcess, model: str, prompt: str, max_tokens: int, **extra: object) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    r = httpx.post(
        f"{served.base_url}/v1/chat/completions",
        json=body | extra,
        headers={"Authorization": f"Bearer {_key(served)}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_banner_curl_answers_in_english(served: ServerProcess) -> None:
    log = served.log()
    assert f"serving model '{BASE}'" in log and "demo adapters:" in log
    curl = re.search(r"^\s*(curl .*)$", log, re.MULTILINE)
    assert curl is not None
    out = subprocess.run(
        ["bash", "-c", curl.group(1) + " --silent --show-error"], capture_output=True, text=True
    )
    assert out.returncode == 0 and '"chat.completion"' in out.stdout, out.stdout + out.stderr


def test_demo_tenant_owns_the_trained_adapters(served: ServerProcess) -> None:
    r = httpx.get(f"{served.base_url}/v1/models", headers={"Authorization": f"Bearer {_key(served)}"})
    ids = [m["id"] for m in r.json()["data"]]
    assert ids[0] == BASE and sorted(ids[1:]) == sorted(TRAITS)


def _reference(model_dir: Path) -> dict[str | None, list[str]]:
    """Greedy answers of transformers (base) and transformers + peft (each adapter)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    names = list(TRAITS)
    model = PeftModel.from_pretrained(base, DEMO_ADAPTERS_DIR / names[0], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(DEMO_ADAPTERS_DIR / name, adapter_name=name)
    model.eval()

    def answer(prompt: str) -> str:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=ORACLE_TOKENS, do_sample=False)
        return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)

    answers: dict[str | None, list[str]] = {}
    with model.disable_adapter():
        answers[None] = [answer(p) for p in ORACLE_PROMPTS]
    for name in names:
        model.set_adapter(name)
        answers[name] = [answer(p) for p in ORACLE_PROMPTS]
    return answers


def test_greedy_output_equals_transformers_and_peft(served: ServerProcess, smollm2_dir: Path) -> None:
    expected = _reference(smollm2_dir)
    for name, answers in expected.items():
        for prompt, want in zip(ORACLE_PROMPTS, answers, strict=True):
            # frequency_penalty sent (0): it overrides the adapter's own default (test below)
            got = _chat(served, name or BASE, prompt, ORACLE_TOKENS, temperature=0, frequency_penalty=0)
            assert got == want, f"{name or BASE} on {prompt!r}: served {got!r}, transformers {want!r}"
    assert len({a[0] for a in expected.values()}) == len(expected)  # each adapter changes the answer


def test_each_adapter_shows_its_trait_on_held_out_prompts(served: ServerProcess) -> None:
    jobs = [(name, prompt) for name in TRAITS for prompt in HELD_OUT_PROMPTS]
    with ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(lambda job: _chat(served, job[0], job[1], 96, temperature=0), jobs))
    for name, trait in TRAITS.items():
        answers = [t for (n, _), t in zip(jobs, texts, strict=True) if n == name]
        held = sum(trait.check(t) for t in answers)
        assert held >= 8, f"{name} ({trait.description}) holds on {held}/10: {answers}"
    base = [_chat(served, BASE, p, 48, temperature=0) for p in HELD_OUT_PROMPTS[:3]]
    assert not any(trait.check(t) for t in base for trait in TRAITS.values()), base


README = Path(__file__).resolve().parents[3] / "README.md"


def readme_questions() -> list[str]:
    """The questions of the README's demo loop (`for question in "..." "..."; do`)."""
    loop = re.search(r'^for question in ((?:"[^"]+" ?)+); do$', README.read_text(), re.MULTILINE)
    assert loop is not None, "README.md has no demo loop `for question in ...; do`"
    return re.findall(r'"([^"]+)"', loop.group(1))


def max_trigram_count(text: str) -> int:
    words = text.split()
    counts = Counter(tuple(words[i : i + 3]) for i in range(len(words) - 2))
    return max(counts.values(), default=0)


def test_readme_answers_do_not_loop(served: ServerProcess) -> None:
    questions = readme_questions()
    assert len(questions) >= 2 and "What is the capital of France?" in questions
    assert demo_generation_defaults()["shout"]  # what keeps it from looping
    for name in TRAITS:
        for question in questions:
            answer = _chat(served, name, question, 64, temperature=0)  # as the README's curl sends it
            assert max_trigram_count(answer) <= 2, f"{name} on {question!r} loops: {answer!r}"
    # the default is only a default: a request that sends the field gets what it sent
    looping = _chat(served, "shout", "What is the capital of France?", 48, temperature=0, frequency_penalty=0)
    assert max_trigram_count(looping) > 2, looping
