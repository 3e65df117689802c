"""Stop-string hold-back across chunks, and the one function that decides "done"."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wire.api import TextLine
from wire.sampling_params import SamplingParams
from workers.detokenizer import IncrementalDetokenizer
from workers.request import RequestStatus, SequenceState
from workers.stop import StopContext, StopStringHoldback, check_stop


def run(stops: list[str], chunks: list[str]) -> tuple[list[str], bool, str]:
    """Push chunks until a hit; returns (released per push, hit, still held)."""
    holdback = StopStringHoldback(stops)
    released = []
    for chunk in chunks:
        text, hit = holdback.push(chunk)
        released.append(text)
        if hit:
            return released, True, holdback.pending
    return released, False, holdback.pending


@pytest.mark.parametrize(
    ("stops", "chunks", "released", "hit", "held"),
    [
        # no stops: everything goes straight through
        ([], ["ab", "c"], ["ab", "c"], False, ""),
        # a prefix is held until it is known not to be the stop string
        (["END"], ["Hello E", "N", "X!"], ["Hello ", "", "ENX!"], False, ""),
        (["END"], ["Hello E", "N", "D and more"], ["Hello ", "", ""], True, ""),
        # the stop string inside one chunk: text before it only
        (["END"], ["abcENDdef"], ["abc"], True, ""),
        # overlapping prefixes: "aa" may still become "aab" after a third "a"
        (["aab"], ["a", "a", "a", "b"], ["", "", "a", ""], True, ""),
        # several stops: the match completed first wins, not the first in the list ...
        (["world", "lo w"], ["hello world"], ["hel"], True, ""),
        # ... however the text is cut: "b" completes before "EbE", which starts earlier
        (["b", "EbE"], ["EEbE"], ["EE"], True, ""),
        (["b", "EbE"], ["EEb", "E"], ["EE"], True, ""),
        # the longest held tail is kept: "ab" could start "abc", "b" could start "bcd"
        (["abc", "bcd"], ["xab"], ["x"], False, "ab"),
        (["abc", "bcd"], ["xab", "d"], ["x", "abd"], False, ""),
        (["abc", "bcd"], ["xab", "cd"], ["x", ""], True, ""),
        # multi-byte stop strings work on characters
        (["好的"], ["你好", "的吗"], ["你", ""], True, ""),
        # a prefix never completed stays held until flush
        (["STOP"], ["go ST"], ["go "], False, "ST"),
    ],
)
def test_holdback(stops, chunks, released, hit, held) -> None:
    assert run(stops, chunks) == (released, hit, held)


ALPHABET = "ab \u597d\u7684E"  # few letters, so stop strings and their prefixes recur


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(ALPHABET, max_size=40),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=12),
)
def test_any_chunking_releases_exactly_the_text_before_the_first_completed_stop(
    text, stops, cuts
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    holdback, released, hit = StopStringHoldback(stops), "", False
    for chunk in chunks:
        out, hit = holdback.push(chunk)
        released += out
        if hit:
            break
    # the stop string completed first (earliest end; at a tie, earliest start) cuts the text
    first = min(((i + len(s), i) for s in stops if (i := text.find(s)) >= 0), default=None)
    if first is None:
        assert not hit and released + holdback.flush() == text
    else:
        assert hit and released == text[: first[1]]


def test_flush_releases_what_was_held() -> None:
    holdback = StopStringHoldback(["STOP"])
    assert holdback.push("go ST") == ("go ", False)
    assert holdback.flush() == "ST"
    assert holdback.pending == ""


def make_sequence(params: SamplingParams, prompt_len: int = 2) -> SequenceState:
    table = [b"a", b"b", b"c", b""]  # id 3: a special token
    return SequenceState(
        request_id="r",
        index=0,
        params=params,
        prompt_ids=[0] * prompt_len,
        max_tokens=params.max_tokens or 100,
        detokenizer=IncrementalDetokenizer(table),
        holdback=StopStringHoldback(params.stop),
        generator=None,
    )


def step(seq: SequenceState, token_id: int, ctx: StopContext) -> RequestStatus | None:
    seq.append_token(token_id, None)
    return check_stop(seq, token_id, ctx)


CTX = StopContext(eos_token_ids=frozenset({3}), max_model_len=10)


def test_eos_stops() -> None:
    seq = make_sequence(SamplingParams(max_tokens=5))
    assert step(seq, 0, CTX) is None
    assert step(seq, 3, CTX) == RequestStatus.FINISHED_STOPPED


def test_ignore_eos_keeps_going_and_shows_nothing_for_it() -> None:
    seq = make_sequence(SamplingParams(max_tokens=5, ignore_eos=True))
    assert step(seq, 3, CTX) is None
    assert step(seq, 0, CTX) is None
    assert (seq.take_events() or [None])[0] == TextLine("a", 0, 2, token_ids=[3, 0])


def test_stop_token_id_stops_and_its_text_is_not_shown() -> None:
    seq = make_sequence(SamplingParams(max_tokens=5, stop_token_ids=(1,)))
    assert step(seq, 0, CTX) is None
    assert (seq.take_events() or [None])[0].text == "a"
    assert step(seq, 1, CTX) == RequestStatus.FINISHED_STOPPED
    seq.flush_text()
    assert seq.take_events() == [TextLine("", 0, 1, token_ids=[1])]  # counted, its text not shown


def test_last_tokens_without_text_still_reach_a_line() -> None:
    """An EOS generated as a token (ignore_eos) at max_tokens: no text, but counted and sent, so
    the lines' tokens add up to the usage."""
    seq = make_sequence(SamplingParams(max_tokens=2, ignore_eos=True))
    assert step(seq, 0, CTX) is None
    assert seq.take_events() == [TextLine("a", 0, 1, token_ids=[0])]
    assert step(seq, 3, CTX) == RequestStatus.FINISHED_LENGTH  # 3: the EOS, a special token
    seq.flush_text()
    assert seq.take_events() == [TextLine("", 0, 1, token_ids=[3])]
    seq.flush_text()
    assert seq.take_events() == []  # nothing twice


def test_last_tokens_without_text_keep_no_logprobs() -> None:
    """OpenAI's `logprobs.content` lists the content's tokens: an EOS that ends the choice is
    counted on the last line, without a logprob, as its text is not shown."""
    seq = make_sequence(SamplingParams(max_tokens=5, logprobs=True))
    seq.append_token(0, {"token": "a"})
    assert check_stop(seq, 0, CTX) is None
    assert seq.take_events() == [TextLine("a", 0, 1, [{"token": "a"}], token_ids=[0])]
    seq.append_token(3, {"token": "<eos>"})
    assert check_stop(seq, 3, CTX) == RequestStatus.FINISHED_STOPPED
    seq.flush_text()
    assert seq.take_events() == [TextLine("", 0, 1, [], token_ids=[3])]


def test_max_tokens_is_length_after_exactly_that_many() -> None:
    seq = make_sequence(SamplingParams(max_tokens=3))
    assert [step(seq, 0, CTX) for _ in range(3)] == [None, None, RequestStatus.FINISHED_LENGTH]


def test_context_length_is_length() -> None:
    seq = make_sequence(SamplingParams(max_tokens=None), prompt_len=8)
    assert step(seq, 0, CTX) is None  # 9 tokens in context
    assert step(seq, 0, CTX) == RequestStatus.FINISHED_LENGTH  # 10 = max_model_len


def test_stop_string_on_the_last_allowed_token_reports_stop() -> None:
    seq = make_sequence(SamplingParams(max_tokens=2, stop=("ab",)))
    assert step(seq, 0, CTX) is None
    assert step(seq, 1, CTX) == RequestStatus.FINISHED_STOPPED
