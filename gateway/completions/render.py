"""A run's chat chunks and its `chat.completion`, told as OpenAI's legacy `text_completion`.

A legacy completion is an ordinary run (its log holds chat chunks, its ending a chat
completion, so quotas, the safety window, resume and replay are the chat's own); this renderer
turns what is read back into the legacy shape on the way out, as the Responses renderer does
for its events. Each log chunk becomes at most one `text_completion` chunk, under the same
event id, so `Last-Event-ID` resumes exactly as a chat stream does.
"""

from __future__ import annotations

from typing import Any

import orjson

from adapters.chat_chunks import completion_chunks, logged_events
from adapters.events import Finish, TextDelta, Usage

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


class CompletionRenderer:
    """Renders one run's log chunks as `text_completion` chunks (JSON bytes)."""

    __slots__ = ("_n", "_offsets")

    def __init__(self, n: int) -> None:
        self._n = n
        self._offsets = [0] * n  # characters sent so far per choice: the logprobs' text_offset

    def chunk(self, payload: bytes) -> bytes | None:
        """The legacy chunk for one log chunk; None for one with nothing to say (a role
        chunk). An error chunk passes as it is."""
        chunk = orjson.loads(payload)
        if "error" in chunk:
            return payload
        head = {k: chunk[k] for k in ("id", "created", "model", "service_tier") if k in chunk}
        head["object"] = "text_completion"
        choices: list[dict[str, Any]] = []
        usage = None
        for event in logged_events(payload, self._n):
            if type(event) is TextDelta:
                choices.append(self._text(event))
            elif type(event) is Finish:
                reason = _REASONS.get(event.reason, event.reason)
                choices.append(
                    {"text": "", "index": event.index, "logprobs": None, "finish_reason": reason}
                )
            elif type(event) is Usage:
                usage = event
        if not choices and usage is None:
            return None
        head["choices"] = choices
        if usage is not None:
            head["usage"] = {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens,
            }
        return orjson.dumps(head)

    def _text(self, event: TextDelta) -> dict[str, Any]:
        logprobs = None
        if event.logprobs is not None:
            logprobs = legacy_logprobs(event.logprobs, self._offsets[event.index])
        self._offsets[event.index] += len(event.text)
        return {
            "text": event.text,
            "index": event.index,
            "logprobs": logprobs,
            "finish_reason": None,
        }


def completion_object(raw: bytes) -> dict[str, Any]:
    """A run's final `chat.completion` (its JSON) as the legacy `text_completion` object."""
    completion = orjson.loads(raw)
    choices = []
    for choice in completion["choices"]:
        content = (choice.get("logprobs") or {}).get("content")
        reason = choice.get("finish_reason")
        choices.append(
            {
                "text": choice["message"].get("content") or "",
                "index": choice["index"],
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


def replayed_chunks(raw: bytes, n: int, include_usage: bool) -> list[bytes]:
    """A finished run's legacy chunks rebuilt from its final object (its own events are no
    longer kept): the same content, in fewer chunks."""
    renderer = CompletionRenderer(n)
    chunks = (renderer.chunk(c) for c in completion_chunks(raw, include_usage))
    return [c for c in chunks if c is not None]
