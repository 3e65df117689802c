"""OpenAI's legacy `text_completion` chunk read as internal events: what an OpenAI-compatible
upstream streams for a raw prompt (`/v1/completions`), the sibling of chat_chunks.chunk_events.

The legacy logprobs (parallel `tokens` / `token_logprobs` / `top_logprobs` lists) become the
chat's per-token entries, the internal events' one form; the gateway renders them back into the
legacy form for its own clients (gateway/completions/render.py).
"""

from __future__ import annotations

from typing import Any

from adapters.chat_chunks import BadChunk, typed
from adapters.events import FINISH_REASONS, ErrorEvent, Event, Finish, TextDelta, Usage


def _entry(token: str, logprob: float | None) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprobs(legacy: dict[str, Any]) -> list[dict[str, Any]]:
    """A legacy `logprobs` object as the chat's per-token entries."""
    tokens = typed(legacy.get("tokens"), list, [])
    values = typed(legacy.get("token_logprobs"), list, [])
    tops = typed(legacy.get("top_logprobs"), list, [])
    if len(values) != len(tokens) or (tops and len(tops) != len(tokens)):
        raise BadChunk("logprobs lists of different lengths")
    entries = []
    for i, token in enumerate(tokens):
        entry = _entry(typed(token, str, ""), typed(values[i], (int, float)))
        top = typed(tops[i], dict, {}) if tops else {}
        entry["top_logprobs"] = [_entry(t, typed(lp, (int, float))) for t, lp in top.items()]
        entries.append(entry)
    return entries


def completion_chunk_events(chunk: Any, n: int = 1) -> list[Event]:
    """The internal events in one upstream `text_completion` chunk of a request for `n`
    choices; raises BadChunk for anything malformed."""
    if not isinstance(chunk, dict):
        raise BadChunk("a chunk is a JSON object")
    if "error" in chunk:
        return [ErrorEvent("upstream_error", "The upstream model failed while generating.")]
    events: list[Event] = []
    for choice in typed(chunk.get("choices"), list, ()):
        choice = typed(choice, dict, {})
        index = typed(choice.get("index"), int, 0)
        if not 0 <= index < n:
            raise BadChunk(f"choice index {index} outside 0..{n - 1}")
        text = typed(choice.get("text"), str, "")
        legacy = typed(choice.get("logprobs"), dict)
        logprobs = None if legacy is None else chat_logprobs(legacy)
        if text or logprobs:
            events.append(TextDelta(text, index, 1, logprobs))
        reason = typed(choice.get("finish_reason"), str)
        if reason:
            events.append(Finish(reason if reason in FINISH_REASONS else "stop", index))
    usage = typed(chunk.get("usage"), dict)
    if usage:
        prompt = typed(usage.get("prompt_tokens"), int, 0)
        events.append(Usage(prompt, typed(usage.get("completion_tokens"), int, 0)))
    return events
