"""Hermes/Qwen2-style tool calls in a sequence's text: `<tool_call>{json}</tool_call>`.

The parser sits after the stop-string hold-back: it sees released text in whatever pieces the
detokenizer made and splits it into plain text and whole calls. Whole, not streamed argument by
argument: the name must be known before anything of a call goes out, and the JSON must parse.

NOTE: like the stop-string hold-back, text that could begin `<tool_call>` is held until it is
known not to, so the markup never leaks as text; whitespace right before a call or right after
one is dropped (the model's separators between calls, not content). A call whose body is not a
JSON object with a string `name` (malformed JSON, a cut-off call at the end, a wrong shape) is
released as the plain text the model wrote, markup included: nothing the model produced is lost,
and the client sees why no call came. An unterminated call that is nevertheless a complete JSON
object at the end of the sequence (EOS, or max_tokens, before `</tool_call>` or in the middle of
it) counts as a call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import orjson

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A parsed call; `arguments` is the arguments object as a compact JSON string."""

    name: str
    arguments: str


Segment = str | ToolCall


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def parse_call(body: str) -> ToolCall | None:
    """The call in one `<tool_call>` body, or None when it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        return ToolCall(value["name"], arguments)
    return ToolCall(value["name"], orjson.dumps(arguments).decode())


class ToolCallParser:
    """Turns released text into text segments and calls, in order."""

    __slots__ = ("_after_call", "_buffer", "_inside", "calls")

    def __init__(self) -> None:
        self._buffer = ""
        self._inside = False
        self._after_call = False  # whitespace after a call is the model's separator: dropped
        self.calls = 0  # calls parsed so far

    def push(self, text: str) -> list[Segment]:
        """Add text; return what is now known to be text or a call."""
        self._buffer += text
        out: list[Segment] = []
        while True:
            if self._inside:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    return out
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE) :]
                self._inside = False
                self._close(body, out, closed=True)
                continue
            at = self._buffer.find(OPEN)
            if at < 0:
                held = _partial_suffix(self._buffer, OPEN)
                head = self._buffer[: len(self._buffer) - held]
                safe = head.rstrip()  # whitespace waits: it is dropped if a call follows
                self._emit(safe, out)
                self._buffer = self._buffer[len(safe) :]
                return out
            self._emit(self._buffer[:at].rstrip(), out)
            self._buffer = self._buffer[at + len(OPEN) :]
            self._inside = True

    def flush(self) -> list[Segment]:
        """The sequence ended: an open call is a call if its JSON is whole, else text."""
        out: list[Segment] = []
        if self._inside:  # a `</tool_call>` cut short (max_tokens) does not spoil a whole call
            body = self._buffer[: len(self._buffer) - _partial_suffix(self._buffer, CLOSE)]
            self._close(body, out, closed=False)
        else:
            self._emit(self._buffer, out)
        self._buffer, self._inside = "", False
        return out

    def _close(self, body: str, out: list[Segment], *, closed: bool) -> None:
        call = parse_call(body)
        if call is None:
            self._emit(OPEN + body + (CLOSE if closed else ""), out, raw=True)
            return
        self.calls += 1
        self._after_call = True
        out.append(call)

    def _emit(self, text: str, out: list[Segment], *, raw: bool = False) -> None:
        if self._after_call and not raw:
            text = text.lstrip()
        if not text:
            return
        self._after_call = False
        if out and isinstance(out[-1], str):
            out[-1] += text
        else:
            out.append(text)
