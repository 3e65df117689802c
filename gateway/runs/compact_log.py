"""An ended run's event log, packed: one bytes buffer and a few flat arrays instead of a tuple, a
bytes and a str per event.

A gateway keeps thousands of ended runs for resumes and replays (design §3). As tuples, each
event is three or four heap objects, and the payloads are whatever the JSON encoder allocated
(orjson's buffers keep their 4 KiB capacity); packed, a run is a handful of objects whose size is
what they hold, none of them tracked by the garbage collector. A live run keeps its deque, where
appends are cheap; the store packs the log once, when the run ends, and reads back the same
`LogEvent` tuples, so a resume cannot tell the two apart.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from gateway.runs.store import LogEvent

NO_TEXT = -1  # the choice index kept for an event that is not a plain text delta (text None)
# Per event: where its payload ends in `payloads`, where its text ends in `texts`, its choice.
# NOTE: packed into bytes, not array('I'): arrays are tracked by the garbage collector, bytes
# are not, so a packed run adds one object (this one) to what a full collection walks.
ROW = struct.Struct("=IIi")
PACKED_OVERHEAD = 200  # bytes the packed log costs beyond its buffers (the objects themselves)


@dataclass(slots=True, frozen=True)
class CompactLog:
    """Events `first_seq`, `first_seq + 1`, … : row i of `rows` says where event i's payload
    and text end in `payloads` and `texts` (each starts where the previous one ended) and its
    choice index (`NO_TEXT` where the text is None)."""

    first_seq: int
    payloads: bytes
    texts: str
    rows: bytes

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
        return cls(first_seq, b"".join(payloads), "".join(texts), bytes(rows))

    def __len__(self) -> int:
        return len(self.rows) // ROW.size

    def __getitem__(self, i: int) -> LogEvent:
        """Event i of the log (negative i counts from the end), as the live log held it."""
        count = len(self.rows) // ROW.size
        if i < 0:
            i += count
        if not 0 <= i < count:
            raise IndexError(i)
        payload_start, text_start, _ = (
            ROW.unpack_from(self.rows, (i - 1) * ROW.size) if i else (0, 0, 0)
        )
        payload_end, text_end, index = ROW.unpack_from(self.rows, i * ROW.size)
        payload = self.payloads[payload_start:payload_end]
        if index == NO_TEXT:
            return (self.first_seq + i, payload, None, 0)
        return (self.first_seq + i, payload, self.texts[text_start:text_end], index)

    def __iter__(self) -> Iterator[LogEvent]:
        return (self[i] for i in range(len(self)))

    @property
    def size(self) -> int:
        """The bytes the packed log holds (what the store's retention limits count)."""
        if not self.rows:
            return 0
        chars = len(self.texts) * (1 if self.texts.isascii() else 4)
        return len(self.payloads) + chars + len(self.rows) + PACKED_OVERHEAD
