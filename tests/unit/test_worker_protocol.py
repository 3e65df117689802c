"""Parsing /v1/generate bodies: defaults, strict types, and the field named on every refusal."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wire.api import BadRequest
from wire.generate_body import GenerateRequest, parse_generate
from wire.sampling_params import SamplingParams
from wire.share import Share


def body(**overrides) -> dict:
    base = {"request_id": "chatcmpl-1", "messages": [{"role": "user", "content": "Hi"}]}
    return {**base, **overrides}


def test_defaults_follow_the_api_doc() -> None:
    parsed = parse_generate(body())
    assert parsed.request_id == "chatcmpl-1"
    assert parsed.messages == [{"role": "user", "content": "Hi"}]
    assert parsed.params == SamplingParams()


def test_all_fields_and_unknown_fields_ignored() -> None:
    parsed = parse_generate(
        body(
            max_tokens=64,
            temperature=0,
            top_p=0.5,
            top_k=4,
            seed=3,
            stop=["END"],
            stop_token_ids=[2],
            n=2,
            presence_penalty=0.1,
            frequency_penalty=0.2,
            logprobs=True,
            top_logprobs=2,
            ignore_eos=True,
            something_new={"x": 1},
        )
    )
    assert parsed.params == SamplingParams(
        max_tokens=64,
        temperature=0.0,
        top_p=0.5,
        top_k=4,
        seed=3,
        stop=("END",),
        stop_token_ids=(2,),
        n=2,
        presence_penalty=0.1,
        frequency_penalty=0.2,
        logprobs=True,
        top_logprobs=2,
        ignore_eos=True,
    )


def test_null_means_default_and_a_single_stop_string_is_accepted() -> None:
    parsed = parse_generate(body(max_tokens=None, seed=None, stop="END", temperature=None))
    assert parsed.params.max_tokens is None
    assert parsed.params.temperature == 1.0
    assert parsed.params.stop == ("END",)


@pytest.mark.parametrize(
    ("raw", "param", "code"),
    [
        ([], None, "invalid_type"),
        ({"messages": [{"role": "user", "content": "x"}]}, "request_id", "invalid_type"),
        (body(request_id=""), "request_id", "invalid_type"),
        (body(messages=[]), "messages", "invalid_type"),
        (body(messages=[{"role": "robot", "content": "x"}]), "messages", "invalid_value"),
        (body(messages=[{"role": "user", "content": ["x"]}]), "messages", "invalid_type"),
        (body(max_tokens="5"), "max_tokens", "invalid_type"),
        (body(max_tokens=True), "max_tokens", "invalid_type"),
        (body(max_tokens=0), "max_tokens", "invalid_value"),
        (body(temperature="hot"), "temperature", "invalid_type"),
        (body(temperature=3), "temperature", "invalid_value"),
        (body(top_k=1.5), "top_k", "invalid_type"),
        (body(stop=[1]), "stop", "invalid_type"),
        (body(stop_token_ids=[True]), "stop_token_ids", "invalid_type"),
        (body(n=0), "n", "invalid_value"),
        (body(logprobs="yes"), "logprobs", "invalid_type"),
        (body(ignore_eos=1), "ignore_eos", "invalid_type"),
        (body(shared_system_prompt="yes"), "shared_system_prompt", "invalid_type"),
        (body(share=[]), "share", "invalid_value"),
        (body(share={"tenant": 7}), "share.tenant", "invalid_value"),
        (body(share={"weight": 0}), "share.weight", "invalid_value"),
        (body(share={"weight": "2"}), "share.weight", "invalid_value"),
        (body(share={"tier": "gold"}), "share.tier", "invalid_value"),
    ],
)
def test_refusals_name_the_field(raw, param: str | None, code: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_generate(raw)
    assert (info.value.param, info.value.code) == (param, code)


GENERATE_FIELDS = [
    "request_id",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "top_logprobs",
    "ignore_eos",
    "shared_system_prompt",
    "share",
]


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(GENERATE_FIELDS),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
            lambda inner: (
                st.lists(inner, max_size=3)
                | st.dictionaries(st.sampled_from(["role", "content", "x"]), inner, max_size=3)
            ),
            max_leaves=8,
        ),
    )
)
def test_any_json_is_parsed_or_refused_with_a_named_field(fields) -> None:
    body = {"request_id": "r", "messages": [{"role": "user", "content": "hi"}], **fields}
    try:
        parse_generate(body)
    except BadRequest as refused:
        assert refused.param is None or refused.param.split(".")[0] in GENERATE_FIELDS


def test_the_adapters_body_parses_back_to_the_same_parameters() -> None:
    params = SamplingParams(
        max_tokens=9, temperature=0.5, top_p=0.9, seed=7, stop=("END",), n=2, logprobs=True
    )
    body = GenerateRequest("r", [{"role": "user", "content": "hi"}], params).to_json()
    parsed = parse_generate(orjson.loads(body))
    assert (parsed.request_id, parsed.messages, parsed.params) == (
        "r",
        [{"role": "user", "content": "hi"}],
        params,
    )


def test_the_shared_system_prompt_flag_travels_only_when_set() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    flagged = GenerateRequest("r", messages, SamplingParams(), shared_system_prompt=True)
    assert orjson.loads(flagged.to_json())["shared_system_prompt"] is True
    assert parse_generate(orjson.loads(flagged.to_json())).shared_system_prompt is True
    plain = orjson.loads(GenerateRequest("r", messages, SamplingParams()).to_json())
    assert "shared_system_prompt" not in plain
    assert parse_generate(plain).shared_system_prompt is False


def test_the_share_travels_when_set_and_defaults_to_the_default_tenant() -> None:
    share = Share("d1g35t", 3.0, "priority")
    sent = GenerateRequest("r", [{"role": "user", "content": "hi"}], SamplingParams(), share=share)
    assert orjson.loads(sent.to_json())["share"] == {
        "tenant": "d1g35t",
        "weight": 3.0,
        "tier": "priority",
    }
    assert parse_generate(orjson.loads(sent.to_json())).share == share
    assert parse_generate(body()).share == Share("", 1.0, "default")
