"""Splitting byte streams into records, whatever the read boundaries."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.framing import LineSplitter, SSEDataSplitter

STREAM = (
    b": ping\n\n"
    b'id: 1\ndata: {"a":"\xe4\xbd\xa0"}\n\n'
    b"event: x\r\ndata: line1\r\ndata: line2\r\n\r\n"
    b"data:nospace\n\n"
    b"data: [DONE]\n\n"
)


def feed_in_pieces(splitter, data: bytes, size: int) -> list[bytes]:
    out = []
    for i in range(0, len(data), size):
        out += splitter.feed(data[i : i + size])
    return out


def test_sse_payloads_whatever_the_read_size():
    expected = [b'{"a":"\xe4\xbd\xa0"}', b"line1\nline2", b"nospace", b"[DONE]"]
    for size in (1, 2, 3, 5, 8, 13, len(STREAM)):
        assert feed_in_pieces(SSEDataSplitter(), STREAM, size) == expected, size


def test_lines_whatever_the_read_size():
    data = b'{"type":"text"}\n{"type":"usage"}\r\n\n{"type":"fin'
    for size in (1, 4, 7, len(data)):
        splitter = LineSplitter()
        assert feed_in_pieces(splitter, data, size) == [b'{"type":"text"}', b'{"type":"usage"}']
        assert splitter.feed(b'ish"}\n') == [b'{"type":"finish"}']


@settings(max_examples=200)
@given(
    payloads=st.lists(st.binary().map(lambda b: b.replace(b"\n", b"").replace(b"\r", b""))),
    before=st.sampled_from([b"", b"data: par", b"data: a\n", b": ping\n"]),
)
def test_a_read_of_one_whole_event_is_split_as_any_other(payloads, before):
    """A read that is one whole `data:` event (the usual one, taken whole) gives what the
    line-by-line split gives, whatever was pending before it."""
    reads = [before] + [b"data: " + p + b"\n\n" for p in payloads]
    whole = SSEDataSplitter()
    got = [payload for read in reads for payload in whole.feed(read)]
    by_byte = feed_in_pieces(SSEDataSplitter(), b"".join(reads), 1)
    assert got == by_byte
