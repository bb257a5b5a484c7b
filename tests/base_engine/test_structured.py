"""Constrained decoding in the engine: grammar rows share batches with free rows without changing them,
every constrained output parses and validates, and the matcher stays consistent through preemption."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from base_engine import LLM, SamplingParams
from base_engine.constraints import GrammarCompiler, allowed_tokens
from base_engine.sampler import Sampler, SamplingRow
from tests.harness.engine_inputs import random_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(tiny_llama_dir, num_kv_blocks=256, block_size=4)


@pytest.fixture(scope="module")
def compiler(llm: LLM) -> GrammarCompiler:
    engine = llm.engine
    return GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)


def constrained(compiler: GrammarCompiler, schema=SCHEMA, **kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 120)
    return SamplingParams(constraint=compiler.compile_json_schema(schema).new_constraint(), **kwargs)


@pytest.mark.slow
def test_constrained_rows_validate_and_leave_free_rows_unchanged(llm: LLM, compiler: GrammarCompiler) -> None:
    prompts = random_prompts(12, 500, 2, 20, seed=3)
    free = [SamplingParams(max_tokens=12, temperature=t, seed=i) for i, t in enumerate([0.0, 1.0] * 3)]
    alone = llm.generate(prompts[:6], free)
    grammar = [constrained(compiler, temperature=t, seed=i) for i, t in enumerate([0.0, 0.8, 1.0] * 2)]
    mixed = llm.generate(prompts, free + grammar)
    for a, b in zip(alone, mixed[:6], strict=True):
        assert a.token_ids == b.token_ids  # the masks touch their own rows only
    for out in mixed[6:]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.mark.slow
def test_shared_params_get_their_own_matcher(llm: LLM, compiler: GrammarCompiler) -> None:
    params = constrained(compiler, temperature=1.0)
    outs = llm.generate(random_prompts(4, 500, 2, 10, seed=5), params)
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)


@pytest.mark.slow
def test_json_object_mode(llm: LLM, compiler: GrammarCompiler) -> None:
    outs = llm.generate(
        random_prompts(4, 500, 2, 10, seed=6), [constrained(compiler, None, seed=i) for i in range(4)]
    )
    for out in outs:
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:  # cut by max_tokens: still the start of an object
            assert out.text.startswith("{")


@pytest.mark.slow
def test_preemption_keeps_the_matcher_consistent(tiny_llama_dir: Path, compiler: GrammarCompiler) -> None:
    llm = LLM(tiny_llama_dir, num_kv_blocks=40, block_size=4, max_num_batched_tokens=64)
    prompts = random_prompts(12, 500, 10, 30, seed=8)
    outs = llm.generate(prompts, [constrained(compiler, temperature=1.0, seed=i) for i in range(12)])
    assert llm.engine.stats().num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_sync_rolls_back_tokens_the_engine_did_not_keep(compiler: GrammarCompiler) -> None:
    constraint = compiler.compile_json_schema(SCHEMA).new_constraint()
    ids = compiler.tokenizer.tokenize_str('{"name":"x')  # compact JSON: no space after ':'
    constraint.sync(ids)
    assert constraint.num_consumed == len(ids)
    before = allowed_tokens([constraint], compiler.vocab_size)
    constraint.accept(ids[-1])  # a token the engine then dropped
    constraint.sync(ids)
    assert constraint.num_consumed == len(ids) and not constraint.is_error
    assert torch.equal(allowed_tokens([constraint], compiler.vocab_size), before)


def test_sampler_masks_only_constrained_rows(compiler: GrammarCompiler) -> None:
    vocab = compiler.vocab_size
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    grammar = compiler.compile_lark('start: "7"')
    rows = [
        SamplingRow(SamplingParams(temperature=0.0), [1], [], None),
        SamplingRow(SamplingParams(temperature=0.0, constraint=grammar.new_constraint()), [1], [], None),
        SamplingRow(SamplingParams(temperature=1.0, seed=1, logprobs=1), [1], [], 1),
    ]
    before = logits.clone()
    out = Sampler(seed=0)(logits, rows)
    assert torch.equal(logits, before)  # the caller's logits are not written
    assert out.token_ids[0] == int(logits[0].argmax())
    assert compiler.tokenizer.decode_str([out.token_ids[1]]) == "7"
    assert rows[1].params.constraint.num_consumed == 1


def test_invalid_schema_is_refused(compiler: GrammarCompiler) -> None:
    with pytest.raises(ValueError):
        compiler.compile_json_schema({"type": "object", "properties": {"a": {"type": "no-such-type"}}})
