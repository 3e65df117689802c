"""A streamed chat completion as a client reads it: SSE frames parsed by hand, checked one by one.

sluicegate's framing (design §4): a `retry:` hint first, `id: <seq>` then `data: <chunk JSON>` and
a blank line per event, `: ping` comment lines while idle, a failure after the start as one
`data: {"error": …}` frame (no id), and always `data: [DONE]` last. Every departure from that is
a `StreamViolation`, which the load users report as a failure. Frames are timed as their blank
line arrives, so TTFT and inter-token gaps are what a client would see.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field


class StreamViolation(Exception):
    """The stream broke sluicegate's SSE contract (the message says how)."""


@dataclass(slots=True)
class Frame:
    event_id: int | None
    data: str
    at: float  # perf_counter when the frame was complete


def parse_frames(chunks: Iterable[bytes]) -> Iterator[Frame]:
    """SSE frames from raw body chunks (split anywhere, even inside a line)."""
    buf = b""
    event_id: int | None = None
    data: list[str] = []
    for chunk in chunks:
        buf += chunk
        while (end := buf.find(b"\n")) >= 0:
            line, buf = buf[:end].rstrip(b"\r"), buf[end + 1 :]
            if not line:
                if data:
                    yield Frame(event_id, "\n".join(data), time.perf_counter())
                elif event_id is not None:
                    raise StreamViolation(f"frame {event_id} has an id but no data")
                event_id, data = None, []
                continue
            if line.startswith(b":"):  # a comment: `: ping` heartbeats
                continue
            name, _, value = line.partition(b":")
            value = value.removeprefix(b" ")
            if name == b"id":
                if not value.isdigit():
                    raise StreamViolation(f"malformed frame: id {value[:40]!r} is not a number")
                event_id = int(value)
            elif name == b"data":
                data.append(value.decode("utf-8"))
            elif name == b"retry":  # the reconnection hint a stream opens with
                if not value.isdigit():
                    raise StreamViolation(f"malformed retry line {line[:60]!r}")
            else:
                raise StreamViolation(f"malformed frame: unexpected line {line[:60]!r}")
    if buf.strip() or data:
        raise StreamViolation("the stream ended inside a frame")


@dataclass(slots=True)
class ChatStream:
    """One stream of one run, read as far as asked; `first_id` is the id its first event must
    carry (1 for a new stream or a replay, N + 1 for a resume after event N)."""

    chunks: Iterable[bytes]
    sent: float  # perf_counter when the request went out
    first_id: int = 1
    run_id: str | None = None
    last_id: int = 0
    gaps: int = 0  # ids skipped after the first: merged text of a client that fell behind
    text: list[str] = field(default_factory=list)
    content_at: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    error: dict | None = None
    done: bool = False
    _frames: Iterator[Frame] | None = field(default=None, init=False, repr=False)

    @property
    def content(self) -> str:
        return "".join(self.text)

    def read(self, content_frames: int | None = None) -> None:
        """Read to `[DONE]`, or until `content_frames` more frames with text have arrived."""
        if self._frames is None:
            self._frames = parse_frames(self.chunks)
        want = None if content_frames is None else len(self.text) + content_frames
        for frame in self._frames:
            self._take(frame)
            if want is not None and len(self.text) >= want:
                return
        if not self.done:
            raise StreamViolation("the stream ended without data: [DONE]")

    def _take(self, frame: Frame) -> None:
        if self.done:
            raise StreamViolation("a frame after data: [DONE]")
        if frame.data == "[DONE]":
            self.done = True
            return
        if self.error is not None:
            raise StreamViolation("a frame after the error frame (only [DONE] may follow)")
        try:
            body = json.loads(frame.data)
        except ValueError:
            raise StreamViolation(
                f"malformed frame: data is not JSON: {frame.data[:60]!r}"
            ) from None
        if not isinstance(body, dict):
            raise StreamViolation("malformed frame: data is not a JSON object")
        if "error" in body:
            self._take_error(body["error"])
        else:
            self._take_chunk(frame, body)

    def _take_error(self, error: object) -> None:
        if not isinstance(error, dict) or not isinstance(error.get("code"), str):
            raise StreamViolation(f"malformed error frame: {error!r:.80}")
        self.error = error

    def _take_chunk(self, frame: Frame, chunk: dict) -> None:
        if chunk.get("object") != "chat.completion.chunk":
            raise StreamViolation(f"not a chat.completion.chunk: {chunk.get('object')!r}")
        self._check_ids(frame.event_id, chunk.get("id"))
        if not chunk["choices"]:
            self.usage = chunk.get("usage")
            if self.usage is None:
                raise StreamViolation("a chunk with no choices and no usage")
            return
        if self.usage is not None:
            raise StreamViolation("a choice chunk after the usage chunk")
        for choice in chunk["choices"]:
            piece = choice.get("delta", {}).get("content")
            if piece:
                self.text.append(piece)
                self.content_at.append(frame.at)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]

    def _check_ids(self, event_id: int | None, run_id: object) -> None:
        if not isinstance(run_id, str) or not run_id.startswith("chatcmpl-"):
            raise StreamViolation(f"malformed chunk id {run_id!r}")
        if self.run_id is None:
            self.run_id = run_id
        elif run_id != self.run_id:
            raise StreamViolation(f"chunk of another run: {run_id} in {self.run_id}")
        if event_id is None:
            raise StreamViolation("a chunk frame without an id: line")
        if self.last_id == 0:
            if event_id != self.first_id:
                raise StreamViolation(f"first event id {event_id}, expected {self.first_id}")
        elif event_id <= self.last_id:
            raise StreamViolation(f"event id {event_id} after {self.last_id}: repeated or back")
        elif event_id != self.last_id + 1:
            self.gaps += 1  # legal only as a slow client's merged chunk: text is checked later
        self.last_id = event_id

    def ttft_ms(self) -> float | None:
        return None if not self.content_at else (self.content_at[0] - self.sent) * 1000

    def gaps_ms(self) -> list[float]:
        """Inter-token gaps: between consecutive frames with text."""
        at = self.content_at
        return [(b - a) * 1000 for a, b in itertools.pairwise(at)]
