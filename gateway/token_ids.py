"""Token ids as OpenAI's APIs take them in place of text (a completions `prompt`, an
embeddings `input`): arrays of integers, checked here for shape and range; the worker checks
them against its own vocabulary."""

from __future__ import annotations

from typing import Any

from gateway.http.errors import invalid_request

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


def texts_or_ids(value: Any, field: str, limit: int) -> list[str | list[int]]:
    """A `prompt` or `input` as OpenAI takes it: a string, an array of strings, an array of
    token ids or an array of such arrays, at most `limit` of them and none empty; otherwise an
    APIError (400) naming `field`."""
    if value is None:
        raise invalid_request(
            field, f"Missing required parameter: '{field}'.", code="missing_required_parameter"
        )
    if isinstance(value, str):
        items: list[str | list[int]] = [value]
    elif is_token_ids(value):
        items = [as_ids(value)]
    elif isinstance(value, list) and value and all_alike(value):
        items = [v if isinstance(v, str) else as_ids(v) for v in value]
    else:
        raise invalid_request(
            field,
            f"Invalid type for '{field}': expected a string, an array of strings, an array of "
            f"token ids (integers from 0 to {MAX_TOKEN_ID}) or an array of such arrays, none "
            "of them empty.",
            code="invalid_type",
        )
    if any(v == "" for v in items):
        raise invalid_request(field, f"Invalid '{field}': a string must not be empty.")
    if len(items) > limit:
        raise invalid_request(field, f"Invalid '{field}': at most {limit} per request.")
    return items
