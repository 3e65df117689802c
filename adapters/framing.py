"""Incremental splitting of a byte stream into records (NDJSON lines, SSE data payloads).

Network reads end anywhere; these keep the partial tail and return whole records per read, so one
read becomes one batch of events.
"""

from __future__ import annotations


class LineSplitter:
    """Splits on b"\\n"; strips a trailing b"\\r"; drops empty lines."""

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, data: bytes) -> list[bytes]:
        if self._tail:
            data = self._tail + data
        lines = data.split(b"\n")
        self._tail = lines.pop()
        return [line.rstrip(b"\r") for line in lines if line.strip()]


class SSEDataSplitter:
    """Returns the `data:` payload of each complete server-sent event (multi-line data joined)."""

    __slots__ = ("_data", "_tail")

    def __init__(self) -> None:
        self._tail = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[bytes]:
        # NOTE: a read is most often one whole event, `data: <payload>` and a blank line, with
        # nothing pending before it: its payload is taken whole, without the line loop below
        if (
            not self._tail
            and not self._data
            and chunk.startswith(b"data: ")
            and chunk.endswith(b"\n\n")
            and chunk.count(b"\n") == 2
            and b"\r" not in chunk
        ):
            return [chunk[6:-2]]
        lines = (self._tail + chunk).split(b"\n") if self._tail else chunk.split(b"\n")
        self._tail = lines.pop()
        payloads: list[bytes] = []
        for raw in lines:
            line = raw.rstrip(b"\r")
            if not line:
                if self._data:
                    payloads.append(b"\n".join(self._data))
                    self._data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
            # comments (": ping"), "id:", "event:" and "retry:" lines carry nothing we relay
        return payloads
