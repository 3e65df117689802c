"""An ended run's event log, packed: one compressed buffer and one string instead of a tuple, a
bytes and a str per event.

A gateway keeps thousands of ended runs for resumes and replays (design §3). As tuples, each
event is four heap objects (the tuple, its seq, payload and text: about 400 bytes for a 180-byte
chunk); packed, a run is one object and two buffers, neither tracked by the garbage collector.
The chunks of one run differ in a few bytes (the same id, model and shape around each delta), so
zlib at its fastest level keeps about 1/30 of them, for about 2 µs per event once, when the run
ends. A live run keeps its deque, where appends are cheap; the store packs the log when the run
ends and reads back the same `LogEvent` tuples, so a resume cannot tell the two apart.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from gateway.state.run_store import LogEvent, LogEvents

NO_TEXT = -1  # the choice index kept for an event that is not a plain text delta (text None)
# Per event: where its payload ends among the payloads, where its text ends in `texts`, its
# choice. The rows come first in the compressed buffer, then the payloads, back to back.
# NOTE: bytes, not array('I'): arrays are tracked by the garbage collector, bytes are not.
ROW = struct.Struct("=IIi")
PACKED_OVERHEAD = 200  # bytes the packed log costs beyond its buffers (the objects themselves)
ZLIB_LEVEL = 1  # the fastest: the chunks of a run repeat each other, so it already keeps ~1/30


@dataclass(slots=True, frozen=True)
class CompactLog:
    """Events `first_seq` … `first_seq + count - 1`: `packed` is zlib of their rows (where each
    event's payload and text end, and its choice index, `NO_TEXT` where the text is None), then
    their payloads; `texts` is their texts, back to back."""

    first_seq: int
    count: int
    packed: bytes
    texts: str

    @classmethod
    def pack(cls, events: Iterable[LogEvent]) -> CompactLog:
        """Pack consecutive events (seq n, n + 1, …), oldest first."""
        first_seq = payload_end = text_end = 0
        payloads: list[bytes] = []
        texts: list[str] = []
        rows = bytearray()
        for seq, payload, text, index in events:
            if not payloads:
                first_seq = seq
            elif seq != first_seq + len(payloads):
                raise ValueError(f"event {seq} does not follow {first_seq + len(payloads) - 1}")
            payloads.append(payload)
            payload_end += len(payload)
            if text is not None:
                texts.append(text)
                text_end += len(text)
            rows += ROW.pack(payload_end, text_end, NO_TEXT if text is None else index)
        packed = zlib.compress(bytes(rows) + b"".join(payloads), ZLIB_LEVEL) if payloads else b""
        return cls(first_seq, len(payloads), packed, "".join(texts))

    def __len__(self) -> int:
        return self.count

    @property
    def last_seq(self) -> int:
        return self.first_seq + self.count - 1

    def slice(self, start: int, stop: int) -> LogEvents:
        """Events at positions start … stop - 1 (not sequence numbers), as the live log held
        them; the buffer is unpacked once per call."""
        start, stop = max(start, 0), min(stop, self.count)
        if start >= stop:
            return []
        raw = zlib.decompress(self.packed)
        base = self.count * ROW.size  # where the payloads begin
        payload_at, text_at, _ = (
            ROW.unpack_from(raw, (start - 1) * ROW.size) if start else (0, 0, 0)
        )
        out: LogEvents = []
        for i in range(start, stop):
            payload_end, text_end, index = ROW.unpack_from(raw, i * ROW.size)
            payload = raw[base + payload_at : base + payload_end]
            text = None if index == NO_TEXT else self.texts[text_at:text_end]
            out.append((self.first_seq + i, payload, text, 0 if text is None else index))
            payload_at, text_at = payload_end, text_end
        return out

    def __iter__(self) -> Iterator[LogEvent]:
        return iter(self.slice(0, self.count))

    @property
    def size(self) -> int:
        """The bytes the packed log holds (what the store's retention limits count)."""
        if not self.count:
            return 0
        chars = len(self.texts) * (1 if self.texts.isascii() else 4)
        return len(self.packed) + chars + PACKED_OVERHEAD
