"""The SSE reader of the locust load (deploy/locust/sse_frames.py): what it takes as sluicegate's
framing and what it reports as a broken stream (design §4)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "deploy" / "locust" / "sse_frames.py"
_SPEC = importlib.util.spec_from_file_location("sse_frames", _PATH)
sse_frames = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("sse_frames", sse_frames)
_SPEC.loader.exec_module(sse_frames)
ChatStream, StreamViolation = sse_frames.ChatStream, sse_frames.StreamViolation

RUN = "chatcmpl-abc"


def chunk(seq: int, content: str | None = None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    body = {"id": RUN, "object": "chat.completion.chunk", "choices": [choice]}
    return b"id: %d\ndata: %s\n\n" % (seq, json.dumps(body, ensure_ascii=False).encode())


def usage(seq: int) -> bytes:
    body = {"id": RUN, "object": "chat.completion.chunk", "choices": [], "usage": {"x": 1}}
    return b"id: %d\ndata: %s\n\n" % (seq, json.dumps(body).encode())


DONE = b"data: [DONE]\n\n"
WHOLE = (
    chunk(1, "")
    + chunk(2, "héllo ")
    + b": ping\n"
    + chunk(3, "wörld 😀")
    + chunk(4, finish="length")
    + usage(5)
    + DONE
)


def read(body: bytes, first_id: int = 1, split: int | None = None) -> ChatStream:
    parts = [body] if split is None else [body[i : i + split] for i in range(0, len(body), split)]
    stream = ChatStream(parts, sent=0.0, first_id=first_id)
    stream.read()
    return stream


@pytest.mark.parametrize("split", [None, 1, 7])
def test_a_whole_stream_split_anywhere_reads_the_same(split):
    stream = read(WHOLE, split=split)
    assert (stream.run_id, stream.last_id, stream.gaps) == (RUN, 5, 0)
    assert stream.content == "héllo wörld 😀"
    assert (stream.finish_reason, stream.usage, stream.done) == ("length", {"x": 1}, True)


def test_a_read_can_stop_after_some_text_and_go_on():
    stream = ChatStream([WHOLE], sent=0.0)
    stream.read(1)
    assert (stream.content, stream.last_id, stream.done) == ("héllo ", 2, False)
    stream.read()
    assert stream.done and stream.last_id == 5


def test_a_resume_must_start_right_after_the_last_event_read():
    assert read(chunk(3, "x") + DONE, first_id=3).content == "x"
    with pytest.raises(StreamViolation, match="first event id 4, expected 3"):
        read(chunk(4, "x") + DONE, first_id=3)


def test_a_repeated_or_backward_id_is_a_violation():
    with pytest.raises(StreamViolation, match="repeated or back"):
        read(chunk(1, "a") + chunk(2, "b") + chunk(2, "b") + DONE)


def test_a_later_gap_is_counted_for_the_text_check():
    # a slow client's merged text chunk carries the last merged event's id
    assert read(chunk(1, "a") + chunk(4, "bcd") + DONE).gaps == 1


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (chunk(1, "a"), "without data: \\[DONE\\]"),
        (chunk(1, "a") + DONE + chunk(2, "b"), "after data: \\[DONE\\]"),
        (b"id: 1\ndata: {not json\n\n" + DONE, "not JSON"),
        (b"id: x1\ndata: {}\n\n" + DONE, "not a number"),
        (b"event: message\n" + DONE, "unexpected line"),
        (chunk(1, "a") + b'data: {"error": {"code": "cancelled"}}\n\n' + chunk(2, "b"), "error"),
        (b'data: {"id": "chatcmpl-abc", "object": "chat.completion.chunk"}\n\n', "without an id"),
        (chunk(1, "a")[:-1], "inside a frame"),
    ],
)
def test_broken_framing_is_a_violation(body, problem):
    with pytest.raises(StreamViolation, match=problem):
        read(body)


def test_an_error_frame_then_done_is_kept_for_the_caller_to_judge():
    stream = read(chunk(1, "a") + b'data: {"error": {"code": "cancelled"}}\n\n' + DONE)
    assert stream.error == {"code": "cancelled"} and stream.done
