"""OpenAI's `chat.completion.chunk` both ways, and the `chat.completion` object.

The only code that knows the chunk shape: internal events rendered as chunks (for the run's log
and its clients), and chunks read back as internal events (an OpenAI-compatible upstream's
stream, and a run's log for the Responses renderer). Each streamed event is serialised once: the
part of the chunk that never changes (id, object, created, model) is encoded once per response as
a prefix.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from adapters.events import (
    FINISH_REASONS,
    ErrorEvent,
    Event,
    Finish,
    TextDelta,
    ToolCallDelta,
    Usage,
)


def usage_dict(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


def _tool_call_dict(event: ToolCallDelta) -> dict[str, Any]:
    call: dict[str, Any] = {"index": event.call_index}
    function: dict[str, Any] = {"arguments": event.arguments}
    if event.id is not None:
        call["id"] = event.id
        call["type"] = "function"
    if event.name is not None:
        function["name"] = event.name
    call["function"] = function
    return call


# NOTE: the bytes `orjson.dumps` gives for [{"index": i, "delta": {"content": text},
# "logprobs": None, "finish_reason": None}] and the closing brace of the chunk; filled in by hand
# because a plain text delta is by far the most frequent chunk.
_TEXT_CHOICE = b'[{"index":%d,"delta":{"content":%b},"logprobs":null,"finish_reason":null}]}'


class ChunkRenderer:
    """Renders the events of one response as chunk JSON bytes."""

    __slots__ = ("_prefix",)

    def __init__(
        self,
        completion_id: str,
        model: str,
        created: int | None = None,
        service_tier: str | None = None,
    ) -> None:
        """`service_tier`: the tier that served the run, echoed in every chunk (design §12)."""
        head: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()) if created is None else created,
            "model": model,
        }
        if service_tier is not None:
            head["service_tier"] = service_tier
        head = orjson.dumps(head)
        self._prefix = head[:-1] + b',"choices":'

    def _choices(self, choices: list[dict[str, Any]], tail: bytes = b"}") -> bytes:
        return self._prefix + orjson.dumps(choices) + tail

    def role(self, index: int = 0, usage: Usage | None = None) -> bytes:
        """A choice's first chunk; `usage`: the prompt's tokens so far, where the run wants them
        on its opening (a Messages run's `message_start`)."""
        delta = {"role": "assistant", "content": ""}
        choices = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]
        if usage is None:
            return self._choices(choices)
        return self._choices(choices, b',"usage":' + orjson.dumps(usage_dict(usage)) + b"}")

    def render(self, event: Event) -> bytes | None:
        """The chunk for one event, or None for events that are not chunks (usage, errors)."""
        if type(event) is TextDelta:
            if event.logprobs is None:  # the chunk almost every token becomes
                return self.text(event.text, event.index)
            choice = {
                "index": event.index,
                "delta": {"content": event.text},
                "logprobs": {"content": event.logprobs},
                "finish_reason": None,
            }
        elif type(event) is ToolCallDelta:
            choice = {
                "index": event.index,
                "delta": {"tool_calls": [_tool_call_dict(event)]},
                "logprobs": None,
                "finish_reason": None,
            }
        elif type(event) is Finish:
            choice = {
                "index": event.index,
                "delta": {},
                "logprobs": None,
                "finish_reason": event.reason,
            }
            if event.stop_string is not None:  # vLLM's field: the stop string that matched
                choice["stop_reason"] = event.stop_string
        else:
            return None
        return self._choices([choice])

    def text(self, text: str, index: int) -> bytes:
        """The chunk of a plain text delta (no logprobs)."""
        return self._prefix + _TEXT_CHOICE % (index, orjson.dumps(text))

    def usage(self, usage: Usage) -> bytes:
        return self._prefix + b'[],"usage":' + orjson.dumps(usage_dict(usage)) + b"}"


class CompletionBuilder:
    """Accumulates events into one non-streaming `chat.completion`, as JSON bytes.

    NOTE: logprobs are kept as the JSON they become (each event's list serialised once), not
    as Python dicts: a request for 16 choices of 900 tokens with 20 top logprobs each is a few
    hundred thousand entries, about five times the memory as objects.
    """

    def __init__(self, n: int) -> None:
        self._text: list[list[str]] = [[] for _ in range(n)]
        self._logprobs: list[list[bytes] | None] = [None] * n  # each: a list's inner JSON
        self._tool_calls: list[dict[int, dict[str, Any]]] = [{} for _ in range(n)]
        self._finish: list[str | None] = [None] * n
        self._stop_strings: list[str | None] = [None] * n
        self.usage: Usage | None = None

    def add_text(self, text: str, index: int) -> None:
        """A plain text delta's text (no logprobs)."""
        self._text[index].append(text)

    def add(self, event: Event) -> None:
        if type(event) is TextDelta:
            self._text[event.index].append(event.text)
            if event.logprobs is not None:
                kept = self._logprobs[event.index]
                if kept is None:
                    kept = self._logprobs[event.index] = []
                if event.logprobs:
                    kept.append(orjson.dumps(event.logprobs)[1:-1])
        elif type(event) is ToolCallDelta:
            calls = self._tool_calls[event.index]
            call = calls.setdefault(
                event.call_index,
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if event.id is not None:
                call["id"] = event.id
            if event.name is not None:
                call["function"]["name"] += event.name
            call["function"]["arguments"] += event.arguments
        elif type(event) is Finish:
            self._finish[event.index] = event.reason
            self._stop_strings[event.index] = event.stop_string
        elif type(event) is Usage:
            self.usage = event

    def finish_reason(self, index: int = 0) -> str:
        return self._finish[index] or "stop"

    def build(
        self,
        completion_id: str,
        model: str,
        created: int,
        *,
        early: bool = False,
        service_tier: str | None = None,
    ) -> bytes:
        """The object; `early` for a run that ended before the upstream finished it: a choice
        with no finish has `finish_reason` null, and usage the upstream never reported is null
        (the run end's log line and usage record have what was generated and billed).
        `service_tier`: the tier that served it, when known."""
        choices = []
        for i, parts in enumerate(self._text):
            calls = [self._tool_calls[i][k] for k in sorted(self._tool_calls[i])]
            message: dict[str, Any] = {"role": "assistant", "content": "".join(parts)}
            if calls:
                message["tool_calls"] = calls
                message["content"] = message["content"] or None
            kept = self._logprobs[i]
            logprobs = None
            if kept is not None:
                logprobs = {"content": orjson.Fragment(b"[" + b",".join(kept) + b"]")}
            choice = {
                "index": i,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": self._finish[i] if early else self.finish_reason(i),
            }
            if self._stop_strings[i] is not None:
                choice["stop_reason"] = self._stop_strings[i]
            choices.append(choice)
        usage = self.usage
        if usage is None and not early:
            usage = Usage(0, 0)
        completion: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
        }
        if service_tier is not None:
            completion["service_tier"] = service_tier
        completion["choices"] = choices
        completion["usage"] = None if usage is None else usage_dict(usage)
        return orjson.dumps(completion)


def completion_chunks(raw: bytes, include_usage: bool = False) -> list[bytes]:
    """A finished `chat.completion` (its JSON) as the chunks of a stream, for replaying a run
    whose own events are no longer kept: per choice its role, all its content (and tool calls),
    its finish; then the usage chunk when asked for."""
    completion = orjson.loads(raw)
    renderer = ChunkRenderer(
        completion["id"],
        completion["model"],
        completion["created"],
        completion.get("service_tier"),
    )
    chunks: list[bytes] = []
    for choice in completion["choices"]:
        i, message = choice["index"], choice["message"]
        chunks.append(renderer.role(i))
        logprobs = (choice.get("logprobs") or {}).get("content")
        events: list[Event] = []
        if message.get("content"):
            events.append(TextDelta(message["content"], i, logprobs=logprobs))
        for k, call in enumerate(message.get("tool_calls") or []):
            function = call["function"]
            events.append(
                ToolCallDelta(k, function["arguments"], call["id"], function["name"], index=i)
            )
        if choice.get("finish_reason"):
            events.append(Finish(choice["finish_reason"], i, stop_string_of(choice)))
        chunks += [c for e in events if (c := renderer.render(e)) is not None]
    usage = completion.get("usage")
    if include_usage and usage:
        chunks.append(renderer.usage(Usage(usage["prompt_tokens"], usage["completion_tokens"])))
    return chunks


# -- chunks read back as events --------------------------------------------------------------


class BadChunk(ValueError):
    """An upstream chunk that is not a well-formed `chat.completion.chunk`."""


def typed(value: Any, kind: type | tuple[type, ...], default: Any = None) -> Any:
    """An upstream chunk's field: `default` when absent or null, else of `kind` (a JSON
    boolean is no integer), or BadChunk."""
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise BadChunk(f"expected {kind}, got {type(value).__name__}")
    return value


def chunk_events(chunk: Any, n: int = 1) -> list[Event]:
    """The internal events in one upstream `chat.completion.chunk` of a request for `n`
    choices; raises BadChunk for anything malformed (wrong types, a choice index out of range)."""
    if not isinstance(chunk, dict):
        raise BadChunk("a chunk is a JSON object")
    if "error" in chunk:
        return [ErrorEvent("upstream_error", "The upstream model failed while generating.")]
    events: list[Event] = []
    choices = chunk.get("choices")
    if type(choices) is not list:  # NOTE: the usual chunk skips `typed`'s calls (per chunk)
        choices = typed(choices, list, ())
    for choice in choices:
        text = _plain_text(choice, n)
        if text is None:
            _choice_events(typed(choice, dict, {}), n, events)
        elif text:
            events.append(TextDelta(text, choice.get("index", 0)))
    usage = chunk.get("usage")
    if usage is not None and (usage := typed(usage, dict)):
        prompt = typed(usage.get("prompt_tokens"), int, 0)
        events.append(Usage(prompt, typed(usage.get("completion_tokens"), int, 0)))
    return events


def _plain_text(choice: Any, n: int) -> str | None:
    """The text of a choice that is a plain text delta and nothing else, well formed; None for
    any other choice (read field by field, checked)."""
    # NOTE: most chunks are this one; the exact-type checks here are what _choice_events checks
    if type(choice) is not dict or choice.get("finish_reason") is not None:
        return None
    delta, index = choice.get("delta"), choice.get("index", 0)
    if type(delta) is not dict or type(index) is not int or not 0 <= index < n:
        return None
    content = delta.get("content")
    if type(content) is not str or choice.get("logprobs") is not None or "tool_calls" in delta:
        return None
    return content


def _choice_events(choice: dict[str, Any], n: int, events: list[Event]) -> None:
    index = typed(choice.get("index"), int, 0)
    if not 0 <= index < n:
        raise BadChunk(f"choice index {index} outside 0..{n - 1}")
    delta = typed(choice.get("delta"), dict, {})
    content = typed(delta.get("content"), str, "")
    if content:
        logprobs = typed(typed(choice.get("logprobs"), dict, {}).get("content"), list)
        events.append(TextDelta(content, index, 1, logprobs))
    for call in typed(delta.get("tool_calls"), list, ()):
        call = typed(call, dict, {})
        function = typed(call.get("function"), dict, {})
        events.append(
            ToolCallDelta(
                typed(call.get("index"), int, 0),
                typed(function.get("arguments"), str, ""),
                typed(call.get("id"), str),
                typed(function.get("name"), str),
                index,
            )
        )
    reason = typed(choice.get("finish_reason"), str)
    if reason:
        reason = reason if reason in FINISH_REASONS else "stop"
        stop_string = stop_string_of(choice) if reason == "stop" else None
        events.append(Finish(reason, index, stop_string))


def stop_string_of(choice: dict[str, Any]) -> str | None:
    """The stop string that ended a choice, from vLLM's `stop_reason` (ours says the same);
    None where it is absent, null, or a stop token's id (an integer)."""
    value = choice.get("stop_reason")
    return value if isinstance(value, str) else None


def logged_events(payload: bytes, n: int = 1) -> list[Event]:
    """The events of one chunk of a run's own log (its role chunk has none)."""
    return chunk_events(orjson.loads(payload), n)
