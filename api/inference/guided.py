"""vLLM's structured-output request fields -> the grammar machinery of api/inference/structured_outputs.py.

- `structured_outputs` {`json` (a schema, or its JSON text), `regex`, `choice` (a list of strings),
  `grammar` (Lark, as vLLM's `guidance` backend takes it), `json_object`, `disable_any_whitespace`};
- the older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

Exactly one constraint per request; together with `response_format` or forced tool calls it is a 400.
What we cannot honour is refused by name, never ignored: `whitespace_pattern`, `structural_tag`,
`guided_decoding_backend` other than `auto` / `guidance` (ours is llguidance), `guided_whitespace_pattern`.
JSON is compact unless `allow_json_whitespace` (or `disable_any_whitespace: false`) asks for whitespace.
"""

from __future__ import annotations

import json
from typing import Any

from api.errors import APIError
from base_engine.constraints import CompiledGrammar, GrammarCompiler, GrammarError

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_LEGACY = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_BACKENDS = (None, "auto", "guidance")


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def guided_constraint(body: Any) -> tuple[str, Any, str, bool | None] | None:
    """(kind, value, the field it came from, whitespace or None = the body's default), or None."""
    if body.guided_decoding_backend not in _BACKENDS:
        raise _bad(
            f"guided_decoding_backend {body.guided_decoding_backend!r} is not served; structured output "
            f"runs on llguidance (expected 'auto' or 'guidance', or leave it out)",
            "guided_decoding_backend",
        )
    if body.guided_whitespace_pattern is not None:
        raise _bad("guided_whitespace_pattern is not supported", "guided_whitespace_pattern")
    found: list[tuple[str, Any, str, bool | None]] = []
    spec = body.structured_outputs
    if spec is not None:
        for field in ("whitespace_pattern", "structural_tag"):
            if spec.get(field) is not None:
                raise _bad(f"structured_outputs.{field} is not supported", f"structured_outputs.{field}")
        unknown = set(spec) - {
            *_KINDS,
            "disable_any_whitespace",
            "disable_fallback",
            "disable_additional_properties",
        }
        if unknown:
            raise _bad(f"unexpected fields in structured_outputs: {sorted(unknown)}", "structured_outputs")
        no_space = spec.get("disable_any_whitespace")
        whitespace = None if no_space is None else not no_space
        found += [
            (k, spec[k], f"structured_outputs.{k}", whitespace)
            for k in _KINDS
            if spec.get(k) not in (None, False)
        ]
    found += [(k, getattr(body, f), f, None) for f, k in _LEGACY.items() if getattr(body, f) is not None]
    if len(found) > 1:
        raise _bad(f"give one structured output constraint, got {[f for _, _, f, _ in found]}", found[1][2])
    return found[0] if found else None


def compile_guided(
    compiler: GrammarCompiler, kind: str, value: Any, param: str, *, whitespace: bool
) -> CompiledGrammar:
    """The grammar of one constraint; a 400 naming `param` when it is malformed or cannot be enforced."""
    try:
        if kind == "json_object":
            return compiler.compile_json_schema(None, whitespace=whitespace)
        if kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            if not isinstance(schema, dict):
                raise _bad(f"{param} must be a JSON schema object", param)
            return compiler.compile_json_schema(schema, whitespace=whitespace)
        if kind == "regex":
            if not isinstance(value, str):
                raise _bad(f"{param} must be a string", param)
            return compiler.compile_regex(value)
        if kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise _bad(f"{param} must be a non-empty list of non-empty strings", param)
            return compiler.compile_lark("start: " + " | ".join(json.dumps(c) for c in value))
        if not isinstance(value, str):
            raise _bad(f"{param} must be a Lark grammar (a string)", param)
        return compiler.compile_lark(value)
    except ValueError as exc:  # json.loads
        raise _bad(f"{param} is not valid JSON: {exc}", param) from None
    except GrammarError as exc:
        raise _bad(f"cannot enforce {param}: {exc}", param) from None
