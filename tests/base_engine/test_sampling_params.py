"""SamplingParams: validation names the field, its value and the allowed range; normalization."""

from __future__ import annotations

import math

import pytest

from base_engine.sampling_params import SamplingParams

BAD_VALUES = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2.0),
    ("max_tokens", True),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1"),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -2),
    ("top_k", 1.5),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3),
    ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("seed", 1.5),
    ("seed", 2**64),
    ("logprobs", -1),
    ("logprobs", 21),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [1]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["2"]),
    ("stop_token_ids", 5),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_invalid_value_names_field_and_value(field: str, value: object) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert field in message and repr(value) in message


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 1},
        {"temperature": 0},
        {"temperature": 2.5},
        {"top_p": 1e-6},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"min_p": 1.0},
        {"presence_penalty": -2, "frequency_penalty": 2},
        {"repetition_penalty": 0.01},
        {"seed": 0},
        {"seed": -(2**63)},
        {"logprobs": 0},
        {"logprobs": 20},
    ],
)
def test_values_at_the_edges_of_the_ranges_are_accepted(kwargs: dict[str, object]) -> None:
    params = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(params, key) == value


def test_range_is_stated_in_the_error() -> None:
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match=r"\[-2, 2\]"):
        SamplingParams(presence_penalty=3)


def test_stop_is_normalized_to_a_tuple() -> None:
    assert SamplingParams().stop == ()
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=["a", "bc"]).max_stop_len == 2
    assert SamplingParams().max_stop_len == 0


def test_stop_token_ids_are_a_fresh_list() -> None:
    ids = (5, 7)
    params = SamplingParams(stop_token_ids=ids)  # type: ignore[arg-type]
    assert params.stop_token_ids == [5, 7] and isinstance(params.stop_token_ids, list)
    assert (
        SamplingParams().stop_token_ids == [] and SamplingParams().stop_token_ids is not params.stop_token_ids
    )


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy  # dividing by this would overflow
    assert not SamplingParams(temperature=0.01).is_greedy
    assert not SamplingParams().is_greedy


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, False),
        ({"repetition_penalty": 1.1}, True),
        ({"frequency_penalty": -0.5}, True),
        ({"presence_penalty": 0.2}, True),
        ({"top_k": 5, "top_p": 0.5, "min_p": 0.1, "temperature": 0.5}, False),
    ],
)
def test_needs_penalties(kwargs: dict[str, object], expected: bool) -> None:
    assert SamplingParams(**kwargs).needs_penalties is expected


def test_slots_refuse_unknown_attributes() -> None:
    params = SamplingParams()
    with pytest.raises(AttributeError):
        params.best_of = 2  # type: ignore[attr-defined]
