"""Token ids as OpenAI's APIs take them in place of text (a completions `prompt`, an
embeddings `input`): arrays of integers, checked here for shape and range; the worker checks
them against its own vocabulary."""

from __future__ import annotations

from typing import Any

MAX_IDS = 1 << 20  # ids in one array: far above any context; the worker's context check is real
# far above any vocabulary (the worker checks against its own); keeps ids within JSON's usual
# 64-bit integers on the way to a backend
MAX_TOKEN_ID = (1 << 31) - 1


def is_token_id(value: Any) -> bool:
    """A token id: an integer >= 0 (JSON's 5.0 is one too, as JSON Schema counts)."""
    if isinstance(value, float):
        return value.is_integer() and 0 <= value <= MAX_TOKEN_ID
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID


def is_token_ids(value: Any) -> bool:
    """A non-empty array of token ids."""
    return isinstance(value, list) and 0 < len(value) <= MAX_IDS and all(map(is_token_id, value))


def all_alike(items: list[Any]) -> bool:
    """All strings, or all arrays of token ids (a mix is nothing OpenAI takes either)."""
    return all(isinstance(p, str) for p in items) or all(is_token_ids(p) for p in items)


def as_ids(value: list[Any]) -> list[int]:
    """Checked ids as ints (5.0 becomes 5)."""
    return [int(t) for t in value]
