"""SamplingParams validation: every out-of-range field is refused and named."""

from __future__ import annotations

import pytest

from wire.sampling_params import InvalidParam, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"stop": tuple("abcdefghijklmnopq")}, "stop"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_invalid_values_name_their_field(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidParam) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"max_tokens": 1, "temperature": 0.0},
        {"temperature": 2.0, "top_p": 1.0, "top_k": 0, "seed": -5},
        {"stop": ["END", "###"], "stop_token_ids": [0, 7], "n": 16},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"logprobs": True, "top_logprobs": 20, "ignore_eos": True},
    ],
)
def test_valid_values_pass(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_derived_flags() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.7).greedy
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert not SamplingParams().has_penalties
    assert SamplingParams(stop=["a"]).stop == ("a",)
