"""Hostile adapter_config.json values that used to crash validation (a 500) are refused with an
`AdapterFormatError` naming the field and the limit: regexes nested 500 groups deep (Python's `re`
compiles groups recursively) in target_modules, layers_pattern and as a rank_pattern key, and a
lora_alpha written as a JSON integer beyond the float range."""

from __future__ import annotations

import json
from typing import Any

import pytest

from adapters import AdapterFormatError
from adapters.files import json_object
from adapters.peft_rank import MAX_ALPHA, MAX_RANK, parse_spec
from adapters.peft_targets import resolve_targets
from adapters.safe_regex import MAX_GROUP_DEPTH, compile_pattern
from tests.harness.peft_adapters import tiny_shapes

BASE: dict[str, Any] = {"peft_type": "LORA", "r": 8, "lora_alpha": 8}
NESTED = "(" * 500 + "q_proj" + ")" * 500


def _parse(cfg: dict[str, Any]) -> None:
    parse_spec(cfg)
    resolve_targets(cfg, tiny_shapes())


@pytest.mark.parametrize(
    ("cfg", "field"),
    [
        (BASE | {"target_modules": NESTED}, "target_modules"),
        (
            BASE | {"target_modules": ["q_proj"], "layers_to_transform": [0], "layers_pattern": NESTED},
            "layers_pattern",
        ),
        (BASE | {"rank_pattern": {NESTED: 4}}, "rank_pattern"),
    ],
    ids=["target_modules", "layers_pattern", "rank_pattern"],
)
def test_deeply_nested_regexes_are_refused_naming_the_limit(cfg: dict[str, Any], field: str) -> None:
    with pytest.raises(AdapterFormatError) as info:
        _parse(cfg)
    message = str(info.value)
    assert message.startswith(field) and f"limit of {MAX_GROUP_DEPTH}" in message and "500 deep" in message


def test_nesting_within_the_limit_still_compiles() -> None:
    pattern = (
        "(" * 8 + "q_proj" + ")" * 8 + r"|[(]+|\(+|[^)(]"
    )  # parentheses in classes and escapes are literals
    assert compile_pattern("target_modules", pattern).fullmatch("q_proj") is not None


@pytest.mark.parametrize("field", ["lora_alpha", "alpha_pattern"])
def test_an_integer_alpha_beyond_the_float_range_is_refused(field: str) -> None:
    huge = 2**1100
    config = json_object(
        json.dumps(BASE | ({field: huge} if field == "lora_alpha" else {field: {"q_proj": huge}})).encode(),
        "adapter_config.json",
    )
    with pytest.raises(AdapterFormatError) as info:
        parse_spec(config)
    message = str(info.value)
    assert field in message and f"{MAX_ALPHA:.4g}" in message and "1101 bits" in message


def test_a_rank_beyond_any_dimension_is_refused() -> None:
    with pytest.raises(AdapterFormatError) as info:
        parse_spec(BASE | {"r": 2**1100})
    assert f"limit of {MAX_RANK}" in str(info.value)


def test_an_integer_past_pythons_digit_limit_is_a_format_error() -> None:
    # json.loads raises a plain ValueError (not JSONDecodeError) past 4300 digits
    data = b'{"r": 8, "lora_alpha": ' + b"9" * 5000 + b"}"
    with pytest.raises(AdapterFormatError, match="adapter_config.json is not valid JSON"):
        json_object(data, "adapter_config.json")
