"""Constrained JSON is compact by default (no whitespace outside strings, as xgrammar's
disable_any_whitespace); `whitespace=True` (a request's `allow_json_whitespace`) allows it again.

A walker that prefers whitespace tokens whenever the grammar allows one writes JSON under each grammar:
compact grammars must leave it no room, flexible ones must.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from base_engine.constraints import GrammarCompiler, allowed_tokens
from base_engine.model.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "integer", "maximum": 9}, "maxItems": 3},
        "nested": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    },
    "required": ["name", "tags", "nested"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Any:
    return load_tokenizer(tiny_llama_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def whitespace_outside_strings(text: str) -> int:
    count, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch.isspace():
            count += 1
    return count


def walk(compiler: GrammarCompiler, tok: Any, grammar: Any, seed: int) -> str:
    """Tokens drawn from the grammar's mask, a whitespace token whenever one is allowed (half the time)."""
    rng = random.Random(seed)
    pieces = {i: tok.decode([i]) for i in range(len(tok))}
    spaces = {i for i, p in pieces.items() if p and p.isspace()}
    constraint = grammar.new_constraint()
    ids: list[int] = []
    for _ in range(120):
        mask = allowed_tokens([constraint], len(tok))[0]
        allowed = [i for i in mask.nonzero().flatten().tolist() if i not in compiler.eos_token_ids]
        if not allowed:
            break
        white = [i for i in allowed if i in spaces]
        token = rng.choice(white) if white and rng.random() < 0.5 else rng.choice(allowed)
        constraint.accept(token)
        ids.append(token)
        if constraint.is_accepting and len(ids) > 60:
            break
    return tok.decode(ids)


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_json_is_compact_by_default_and_whitespace_is_an_option(
    compiler: GrammarCompiler, tokenizer: Any, kind: str
) -> None:
    schema = SCHEMA if kind == "json_schema" else None
    compact = compiler.compile_json_schema(schema)
    for seed in range(4):
        text = walk(compiler, tokenizer, compact, seed)
        assert whitespace_outside_strings(text) == 0, text
        if kind == "json_schema":
            json.loads(text)  # whole: the compact walk cannot pad, so it ends within the steps
    flexible = compiler.compile_json_schema(schema, whitespace=True)
    assert sum(whitespace_outside_strings(walk(compiler, tokenizer, flexible, seed)) for seed in range(4)) > 0


def test_objects_with_properties_admit_no_other_keys_unless_they_say_so(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    open_ = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    nested = {"type": "object", "properties": {"w": {"anyOf": [open_]}}, "required": ["w"]}
    explicit = {**open_, "additionalProperties": True}

    def accepts(schema: dict, text: str) -> bool:
        constraint = compiler.compile_json_schema(schema).new_constraint()
        constraint.sync(tokenizer.encode(text, add_special_tokens=False))
        return not constraint.is_error

    assert accepts(open_, '{"city":"Rome"}') and not accepts(open_, '{"city":"Rome","description":"x"}')
    assert not accepts(nested, '{"w":{"city":"Rome","x":1}}')
    assert accepts(explicit, '{"city":"Rome","description":"x"}')
