"""An OpenAI-compatible upstream's chunks: well-formed ones become events, anything else is a
BadChunk (which the adapter turns into one error event), never a crash in the run."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.chat_chunks import BadChunk, _choice_events, _plain_text, chunk_events
from adapters.events import Finish, TextDelta, ToolCallDelta, Usage


def test_a_well_formed_chunk_becomes_its_events():
    chunk = {
        "choices": [
            {"index": 1, "delta": {"content": "hi"}, "finish_reason": None},
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f"}}]},
                "finish_reason": "tool_calls",
            },
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    assert chunk_events(chunk, n=2) == [
        TextDelta("hi", 1, 1, None),
        ToolCallDelta(0, "", "c1", "f", 0),
        Finish("tool_calls", 0),
        Usage(3, 2),
    ]


@pytest.mark.parametrize(
    "chunk",
    [
        [],
        {"choices": {}},
        {"choices": [{"index": "0", "delta": {"content": "x"}}]},
        {"choices": [{"index": 2, "delta": {"content": "x"}}]},
        {"choices": [{"delta": {"content": ["x"]}}]},
        {"choices": [{"finish_reason": ["stop"]}]},
        {"choices": [{"delta": {"tool_calls": [{"function": {"name": 1}}]}}]},
        {"usage": {"prompt_tokens": "3"}},
    ],
)
def test_malformed_chunks_are_refused(chunk):
    with pytest.raises(BadChunk):
        chunk_events(chunk, n=2)


def test_an_unknown_finish_reason_is_stop():
    assert chunk_events({"choices": [{"finish_reason": "eos"}]}) == [Finish("stop", 0)]


json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "choices",
                    "index",
                    "delta",
                    "content",
                    "tool_calls",
                    "function",
                    "name",
                    "arguments",
                    "id",
                    "finish_reason",
                    "usage",
                    "prompt_tokens",
                    "logprobs",
                ]
            ),
            inner,
            max_size=4,
        )
    ),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(json)
def test_any_json_is_events_or_a_bad_chunk(chunk):
    with contextlib.suppress(BadChunk):  # anything else, a TypeError say, fails the test
        events = chunk_events(chunk, n=2)
        assert all(getattr(e, "index", 0) in (0, 1) for e in events)


@settings(max_examples=400, deadline=None)
@given(json)
def test_the_plain_text_fast_path_reads_a_choice_as_the_checked_path_does(choice):
    text = _plain_text(choice, 2)
    if text is not None:  # the fast path took it: the checked path agrees, event for event
        checked: list = []
        _choice_events(choice, 2, checked)
        assert checked == ([TextDelta(text, choice.get("index", 0))] if text else [])


def test_the_fast_path_takes_a_plain_text_choice():
    assert _plain_text({"index": 1, "delta": {"content": "hi"}}, 2) == "hi"
    assert _plain_text({"index": 1, "delta": {"content": "hi"}, "finish_reason": "stop"}, 2) is None
