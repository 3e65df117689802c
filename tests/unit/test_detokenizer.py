"""Incremental detokenization: whole code points only, special tokens hidden, stop text dropped."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testkit.tiny_model import IM_END, IM_START, build_tiny_tokenizer
from wire.sampling_params import SamplingParams
from workers.detokenizer import IncrementalDetokenizer, TokenTable
from workers.request import RequestStatus, SequenceState
from workers.stop import StopContext, StopStringHoldback, check_stop

# [e4 bd] [a0] = 你, [e5] [a5 bd] = 好, then E N D; id 7 is a special token (no text).
SPLIT_BYTES = [b"\xe4\xbd", b"\xa0", b"\xe5", b"\xa5\xbd", b"E", b"N", b"D", b""]
EOS = 7


def make_sequence(
    text_bytes: list[bytes], stop: tuple[str, ...] = (), max_tokens: int = 100
) -> SequenceState:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop)
    return SequenceState(
        request_id="r",
        index=0,
        params=params,
        prompt_ids=[0],
        max_tokens=max_tokens,
        detokenizer=IncrementalDetokenizer(text_bytes),
        holdback=StopStringHoldback(stop),
        generator=None,
    )


def feed(seq: SequenceState, token_ids: list[int], ctx: StopContext) -> tuple[list[str], object]:
    """Returns the text of every `text` event, and the finish status (None if still going)."""
    texts = []
    for token_id in token_ids:
        seq.append_token(token_id, None)
        status = check_stop(seq, token_id, ctx)
        if status is not None:
            seq.flush_text()  # as the engine does; a no-op after a stop string
        event = (seq.take_events() or [None])[0]
        if event is not None:
            texts.append(event.text)
        if status is not None:
            return texts, status
    return texts, None


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def tiny_table(tiny_tokenizer) -> TokenTable:
    return TokenTable.from_tokenizer(tiny_tokenizer)


def test_split_code_points_then_stop_string_yield_exactly_the_text_before_it() -> None:
    seq = make_sequence(SPLIT_BYTES, stop=("END",))
    texts, status = feed(seq, [0, 1, 2, 3, 4, 5, 6], StopContext(frozenset({EOS}), 1000))
    # the stop string's own tokens end on a line of no text that carries them
    assert texts == ["你", "好", ""]
    assert "".join(texts) == "你好"
    assert status == RequestStatus.FINISHED_STOPPED
    assert seq.num_output_tokens == 7


def test_text_lines_carry_the_tokens_generated_since_the_previous_line() -> None:
    seq = make_sequence(SPLIT_BYTES, stop=("END",))
    ctx = StopContext(frozenset({EOS}), 1000)
    counts = []
    for token_id in [0, 1, 2, 3]:
        seq.append_token(token_id, None)
        assert check_stop(seq, token_id, ctx) is None
        event = (seq.take_events() or [None])[0]
        counts.append(None if event is None else (event.text, event.tokens))
    assert counts == [None, ("你", 2), None, ("好", 2)]


def test_held_back_stop_prefix_is_released_when_the_sequence_ends_by_length() -> None:
    seq = make_sequence(SPLIT_BYTES, stop=("END",), max_tokens=6)
    texts, status = feed(seq, [0, 1, 2, 3, 4, 5], StopContext(frozenset({EOS}), 1000))
    assert status == RequestStatus.FINISHED_LENGTH
    assert texts == ["你", "好", "EN"]


def test_incomplete_code_point_at_length_end_becomes_one_replacement_char() -> None:
    seq = make_sequence(SPLIT_BYTES, max_tokens=3)
    texts, status = feed(seq, [0, 1, 2], StopContext(frozenset({EOS}), 1000))
    assert status == RequestStatus.FINISHED_LENGTH
    assert texts == ["你", "\ufffd"]


def test_eos_ends_the_sequence_and_shows_nothing() -> None:
    seq = make_sequence(SPLIT_BYTES, stop=("END",))
    texts, status = feed(seq, [4, 5, EOS], StopContext(frozenset({EOS}), 1000))
    assert status == RequestStatus.FINISHED_STOPPED
    assert texts == ["EN"]  # "EN" was held as a prefix of END, released at the end


def test_special_tokens_are_hidden(tiny_tokenizer) -> None:
    table = TokenTable.from_tokenizer(tiny_tokenizer)
    start, end = tiny_tokenizer.convert_tokens_to_ids([IM_START, IM_END])
    assert table.text_bytes[start] == b"" and table.text_bytes[end] == b""
    assert table.shown[end] == IM_END.encode()
    ids = tiny_tokenizer("ab", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(table.text_bytes)
    assert "".join(detok.push(i) for i in [start, *ids, end]) + detok.flush() == "ab"


def test_tiny_vocabulary_really_splits_code_points(tiny_tokenizer) -> None:
    """Guards the tests below against passing vacuously on a tokenizer of whole characters."""
    table = TokenTable.from_tokenizer(tiny_tokenizer)
    partial = [b for b in table.text_bytes if b and not _is_utf8(b)]
    assert len(partial) >= 20


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_streamed_text_equals_the_tokenizers_own_decode(tiny_tokenizer, tiny_table, data) -> None:
    """Never half a code point: any id sequence streams to exactly what decode() returns."""
    table = tiny_table
    ids = data.draw(st.lists(st.integers(0, len(tiny_tokenizer) - 1), max_size=40))
    detok = IncrementalDetokenizer(table.text_bytes)
    streamed = "".join(detok.push(i) for i in ids) + detok.flush()
    expected = tiny_tokenizer.decode(
        ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    assert streamed == expected


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.lists(st.integers(1, 8), max_size=64))
def test_any_chunking_of_bytes_decodes_like_the_whole(data: bytes, cuts: list[int]) -> None:
    chunks, rest = [], data
    for cut in cuts:
        chunks.append(rest[:cut])
        rest = rest[cut:]
    chunks.append(rest)
    detok = IncrementalDetokenizer(chunks)
    streamed = "".join(detok.push(i) for i in range(len(chunks))) + detok.flush()
    assert streamed == data.decode("utf-8", errors="replace")
