"""A run's chat chunks and its `chat.completion`, told as OpenAI's legacy `text_completion`.

A legacy completion is an ordinary run (its log holds chat chunks, its ending a chat
completion, so quotas, the safety window, resume and replay are the chat's own); this renderer
turns what is read back into the legacy shape on the way out, as the Responses renderer does
for its events. Each log chunk becomes at most one `text_completion` chunk, under the same
event id, so `Last-Event-ID` resumes exactly as a chat stream does.

A run that is one prompt of several (`CompletionParams.index`) numbers its choices as OpenAI
does for the whole request, `index * n + choice`; with `echo`, each choice's text begins with
the prompt (on a stream, as a chunk of its own before the choice's first text, as vLLM sends it).
"""

from __future__ import annotations

from typing import Any

import orjson

from adapters.chat_chunks import completion_chunks, logged_events
from adapters.events import Finish, TextDelta, Usage
from gateway.completions.request import CompletionParams

_REASONS = {"tool_calls": "stop"}  # a legacy completion has no tool calls to finish with


def legacy_logprobs(content: list[dict[str, Any]], offset: int) -> dict[str, Any]:
    """Chat logprobs (one entry per token) in the legacy form: parallel lists, the top
    alternatives as a token → logprob map, each token's character offset from `offset`."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in content:
        token = entry.get("token", "")
        tokens.append(token)
        token_logprobs.append(entry.get("logprob"))
        top.append({alt["token"]: alt["logprob"] for alt in entry.get("top_logprobs") or ()})
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _choice(text: str, index: int, reason: str | None = None) -> dict[str, Any]:
    return {"text": text, "index": index, "logprobs": None, "finish_reason": reason}


class CompletionRenderer:
    """Renders one run's log chunks as `text_completion` chunks (JSON bytes). `echo`: a
    stream read from its start sends the prompt first (a resume does not repeat it).
    `keep_usage` False: the usage chunk is not sent but kept in `usage` (a merged stream sends
    the runs' usage summed); `head` is the last chunk's id, created, model."""

    __slots__ = ("_echo", "_first", "_keep_usage", "_n", "_offsets", "head", "usage")

    def __init__(
        self, params: CompletionParams, echo: bool = True, keep_usage: bool = True
    ) -> None:
        self._n = params.n
        self._first = params.first_choice
        self._offsets = [0] * params.n  # characters sent so far per choice: logprobs' text_offset
        self._echo = params.echo if echo else None
        self._keep_usage = keep_usage
        self.head: dict[str, Any] = {}
        self.usage: dict[str, int] | None = None

    def chunk(self, payload: bytes) -> bytes | None:
        """The legacy chunk for one log chunk; None for one with nothing to say (a role
        chunk). An error chunk passes as it is."""
        chunk = orjson.loads(payload)
        if "error" in chunk:
            return payload
        head = {k: chunk[k] for k in ("id", "created", "model", "service_tier") if k in chunk}
        head["object"] = "text_completion"
        self.head = head
        choices = self._echoed(chunk)
        usage = None
        for event in logged_events(payload, self._n):
            if type(event) is TextDelta:
                choices.append(self._text(event))
            elif type(event) is Finish:
                reason = _REASONS.get(event.reason, event.reason)
                choices.append(_choice("", self._first + event.index, reason))
            elif type(event) is Usage:
                usage = {
                    "prompt_tokens": event.prompt_tokens,
                    "completion_tokens": event.completion_tokens,
                    "total_tokens": event.total_tokens,
                }
        if usage is not None and not self._keep_usage:
            self.usage, usage = usage, None
        if not choices and usage is None:
            return None
        out = head | {"choices": choices}
        if usage is not None:
            out["usage"] = usage
        return orjson.dumps(out)

    def _echoed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The prompt, once per choice, before anything else of it (its role chunk)."""
        if self._echo is None:
            return []
        return [
            _choice(self._echo, self._first + choice["index"])
            for choice in chunk.get("choices") or ()
            if "role" in (choice.get("delta") or {})
        ]

    def _text(self, event: TextDelta) -> dict[str, Any]:
        logprobs = None
        if event.logprobs is not None:
            logprobs = legacy_logprobs(event.logprobs, self._offsets[event.index])
        self._offsets[event.index] += len(event.text)
        return {
            "text": event.text,
            "index": self._first + event.index,
            "logprobs": logprobs,
            "finish_reason": None,
        }


def completion_object(raw: bytes, params: CompletionParams) -> dict[str, Any]:
    """A run's final `chat.completion` (its JSON) as the legacy `text_completion` object."""
    completion = orjson.loads(raw)
    choices = []
    echo = params.echo or ""
    for choice in completion["choices"]:
        content = (choice.get("logprobs") or {}).get("content")
        reason = choice.get("finish_reason")
        choices.append(
            {
                "text": echo + (choice["message"].get("content") or ""),
                "index": params.first_choice + choice["index"],
                "logprobs": None if content is None else legacy_logprobs(content, 0),
                "finish_reason": _REASONS.get(reason, reason),
            }
        )
    out = {
        "id": completion["id"],
        "object": "text_completion",
        "created": completion["created"],
        "model": completion["model"],
    }
    if "service_tier" in completion:
        out["service_tier"] = completion["service_tier"]
    return out | {"choices": choices, "usage": completion.get("usage")}


def replayed_chunks(raw: bytes, params: CompletionParams) -> list[bytes]:
    """A finished run's legacy chunks rebuilt from its final object (its own events are no
    longer kept): the same content, in fewer chunks."""
    renderer = CompletionRenderer(params)
    chunks = (renderer.chunk(c) for c in completion_chunks(raw, params.include_usage))
    return [c for c in chunks if c is not None]
