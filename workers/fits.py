"""Whether a request can ever run on this worker: the checks made before it is queued.

A request that can never fit (a prompt past the context, `max_tokens` past what is left, more KV
than the whole cache holds) is refused at once with ContextTooLong naming the field to change,
rather than queued to fail later; `fits(tokens)` says whether one sequence of that many tokens
fits the cache (Scheduler.fits).
"""

from __future__ import annotations

from collections.abc import Callable

from workers.engine_outputs import ContextTooLong


def check_generation(
    prompt_len: int,
    max_tokens: int | None,
    continuation: int,
    limit: int,
    fits: Callable[[int], bool],
) -> None:
    """A generation: its prompt within the context `limit`, prompt plus `max_tokens` within it,
    a continuation (its length given) within both, and one sequence of it within the cache."""
    if prompt_len >= limit:
        raise ContextTooLong(
            "messages", f"the prompt is {prompt_len} tokens; this model's context is {limit}"
        )
    if max_tokens is not None and prompt_len + max_tokens > limit:
        raise ContextTooLong(
            "max_tokens",
            f"max_tokens is {max_tokens} but only {limit - prompt_len} tokens are left "
            f"after the {prompt_len}-token prompt",
        )
    room = limit - prompt_len if max_tokens is None else max_tokens
    if continuation > room:
        raise ContextTooLong(
            "continuation",
            f"the continuation is {continuation} tokens but the run has room for {room}",
        )
    if not fits(min(prompt_len + (max_tokens or limit), limit)):
        raise ContextTooLong(
            "max_tokens",
            "the prompt plus max_tokens needs more KV cache than this worker has; lower max_tokens",
        )


def check_embedding(size: int, limit: int, fits: Callable[[int], bool]) -> None:
    """An input to embed: 1 to `limit` tokens (it generates none), within the cache."""
    if not 0 < size <= limit:
        raise ContextTooLong("input", f"the input is {size} tokens; this model takes 1 to {limit}")
    if not fits(size):
        raise ContextTooLong("input", "the input needs more KV cache than this worker has")
