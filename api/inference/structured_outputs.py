"""`response_format` (OpenAI structured outputs) and the grammar of forced tool calls, compiled here.

`{"type": "text"}` (the default) changes nothing. `{"type": "json_object"}` constrains the output to one
JSON object; `{"type": "json_schema", "json_schema": {"name", "description"?, "schema", "strict"?}}` to
JSON valid against `schema`. Both are enforced by constrained decoding (base_engine/constraints.py),
whatever `strict` says: the output always parses (unless cut by `max_tokens` or a stop string).

Compilation runs in the request's worker thread (`plan_generation`), never on the engine thread: the
engine gets a compiled grammar's per-request matcher on `SamplingParams.constraint`. The compiler is
built once per served tokenizer (a second or so for a 128k vocabulary) and memoises grammars by text.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from api.errors import APIError
from api.inference.guided import compile_guided, guided_constraint
from api.inference.tools import ToolPlan, forced_call_grammar
from base_engine.constraints import CompiledGrammar, GrammarCompiler, GrammarError

_compilers: dict[int, tuple[Any, GrammarCompiler]] = {}
_compilers_lock = threading.Lock()
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


def grammar_compiler(engine: Any) -> GrammarCompiler:
    """The compiler for an `LLMEngine`'s tokenizer and vocabulary (built on first use, then shared)."""
    with _compilers_lock:
        hit = _compilers.get(id(engine))
        if hit is not None and hit[0] is engine:
            return hit[1]
        compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
        _compilers[id(engine)] = (engine, compiler)
        return compiler


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    type: str  # "text" | "json_object" | "json_schema"
    schema: dict[str, Any] | None = None  # json_schema only


def _invalid(message: str, param: str = "response_format") -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def parse_response_format(value: dict[str, Any] | None) -> ResponseFormat:
    """Checks the shape of `response_format` (400 naming the field on anything else)."""
    if value is None:
        return ResponseFormat("text")
    kind = value.get("type")
    if kind == "text" or kind == "json_object":
        if set(value) - {"type"}:
            raise _invalid(f"response_format of type {kind!r} takes no other field, got {sorted(value)}")
        return ResponseFormat(kind)
    if kind != "json_schema":
        raise _invalid(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            "response_format.type",
        )
    if set(value) - {"type", "json_schema"}:
        raise _invalid(
            f"unexpected fields in response_format: {sorted(set(value) - {'type', 'json_schema'})}"
        )
    spec = value.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise _invalid("response_format.json_schema is required with type 'json_schema'", param)
    unknown = set(spec) - {"name", "description", "schema", "strict"}
    if unknown:
        raise _invalid(f"unexpected fields in response_format.json_schema: {sorted(unknown)}", param)
    name = spec.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= 64 or set(name) - _NAME_CHARS:
        raise _invalid(
            "response_format.json_schema.name must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-'",
            f"{param}.name",
        )
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise _invalid("response_format.json_schema.schema must be a JSON schema object", f"{param}.schema")
    if spec.get("strict") not in (None, True, False):
        raise _invalid("response_format.json_schema.strict must be a boolean", f"{param}.strict")
    return ResponseFormat("json_schema", schema)


def compile_response_format(
    engine: Any, fmt: ResponseFormat, *, whitespace: bool = False
) -> CompiledGrammar | None:
    """The compiled grammar of a JSON response format (compact unless `whitespace`); None for text."""
    if fmt.type == "text":
        return None
    compiler = grammar_compiler(engine)
    try:
        schema = fmt.schema if fmt.type == "json_schema" else None
        return compiler.compile_json_schema(schema, whitespace=whitespace)
    except GrammarError as exc:
        param = "response_format.json_schema.schema" if fmt.type == "json_schema" else "response_format"
        raise _invalid(f"cannot enforce this schema: {exc}", param) from None


def request_grammar(engine: Any, body: Any, tools: ToolPlan | None) -> CompiledGrammar | None:
    """The compiled grammar a request's output must follow: its `response_format`, or the forced tool
    calls of `tool_choice` "required" / a named function; None when the output is free. JSON is compact
    (no whitespace outside strings) unless the body says `allow_json_whitespace: true`."""
    fmt = parse_response_format(getattr(body, "response_format", None))
    whitespace = bool(getattr(body, "allow_json_whitespace", None))
    forced = None
    if tools is not None:
        forced = forced_call_grammar(tools, engine.tokenizer, whitespace=whitespace)
    guided = guided_constraint(body)  # vLLM's structured_outputs / guided_* (api/inference/guided.py)
    if guided is not None:
        kind, value, param, own_whitespace = guided
        if fmt.type != "text" or forced is not None:
            raise _invalid(f"`{param}` cannot be combined with `response_format` or forced tool calls", param)
        space = whitespace if own_whitespace is None else own_whitespace
        return compile_guided(grammar_compiler(engine), kind, value, param, whitespace=space)
    if fmt.type != "text" and tools is not None and tools.parses:
        raise _invalid(
            "`response_format` cannot be combined with `tools` unless `tool_choice` is 'none'",
            "response_format",
        )
    if forced is not None:
        try:
            return grammar_compiler(engine).compile_lark(forced)
        except GrammarError as exc:
            raise _invalid(f"cannot enforce calls of these tools: {exc}", "tools") from None
    return compile_response_format(engine, fmt, whitespace=whitespace)
