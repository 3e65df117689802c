"""A response's input items: Responses `input` as chat messages, and as the items it lists.

`input` is a string (one user message) or a list of items: messages (`role`, and `content` as a
string or `input_text`/`output_text` parts), `function_call` items (a call the model made, sent
back with the conversation) and `function_call_output` items (its result). Each becomes the
chat message a run is given, and an item with an id for `GET /v1/responses/{id}/input_items`.
"""

from __future__ import annotations

import uuid
from typing import Any

from gateway.http.errors import invalid_request
from wire.limits import shown

ROLES = frozenset({"user", "system", "developer", "assistant"})
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_request(
            where, f"'{where}' must be a string or an array of content parts.", code="invalid_type"
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise invalid_request(
                f"{where}[{j}].type",
                f"Unsupported content part type {_shown(kind)} in '{where}[{j}]': only "
                "'input_text' parts are supported.",
            )
        if not isinstance(part.get("text"), str):
            raise invalid_request(
                f"{where}[{j}].text", f"'{where}[{j}].text' must be a string.", code="invalid_type"
            )
        texts.append(part["text"])
    return "".join(texts)


def _string_field(item: dict[str, Any], name: str, where: str, *, empty: bool = False) -> str:
    value = item.get(name)
    if not isinstance(value, str) or (not value and not empty):
        raise invalid_request(
            f"{where}.{name}",
            f"Missing or invalid parameter: '{where}.{name}' must be a "
            f"{'string' if empty else 'non-empty string'}.",
            code="missing_required_parameter",
        )
    return value


def _message(item: dict[str, Any], where: str) -> tuple[dict, dict]:
    role = item.get("role")
    if role not in ROLES:
        raise invalid_request(
            f"{where}.role",
            f"Invalid value for '{where}.role': {_shown(role)}."
            " Supported roles are 'user', 'system', 'developer' and 'assistant'.",
        )
    text = _text(item.get("content"), f"{where}.content")
    part = "output_text" if role == "assistant" else "input_text"
    listed = {
        "id": _item_id("msg"),
        "type": "message",
        "role": role,
        "status": "completed",
        "content": [{"type": part, "text": text}],
    }
    return {"role": role, "content": text}, listed


def _function_call(item: dict[str, Any], where: str) -> tuple[dict, dict]:
    call_id = _string_field(item, "call_id", where)
    name = _string_field(item, "name", where)
    arguments = _string_field(item, "arguments", where, empty=True)
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    listed = {
        "id": _item_id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }
    return {"role": "assistant", "content": None, "tool_calls": [call]}, listed


def _function_output(item: dict[str, Any], where: str) -> tuple[dict, dict]:
    call_id = _string_field(item, "call_id", where)
    output = _string_field(item, "output", where, empty=True)
    listed = {
        "id": _item_id("fco"),
        "type": "function_call_output",
        "call_id": call_id,
        "output": output,
        "status": "completed",
    }
    return {"role": "tool", "tool_call_id": call_id, "content": output}, listed


_KINDS = {
    "message": _message,
    "function_call": _function_call,
    "function_call_output": _function_output,
}


def input_messages(raw: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the chat messages, the listed items) of a request's `input`."""
    if raw is None:
        raise invalid_request(
            "input", "Missing required parameter: 'input'.", code="missing_required_parameter"
        )
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise invalid_request(
            "input", "'input' must be a string or a non-empty array of items.", code="invalid_type"
        )
    messages: list[dict[str, Any]] = []
    items: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid_request(where, f"'{where}' must be an object.", code="invalid_type")
        kind = item.get("type", "message")
        build = _KINDS.get(kind) if isinstance(kind, str) else None
        if build is None:
            raise invalid_request(
                f"{where}.type",
                f"Unsupported input item type {_shown(kind)} in '{where}': expected 'message', "
                "'function_call' or 'function_call_output'.",
            )
        message, listed = build(item, where)
        previous = messages[-1] if messages else None
        if message.get("tool_calls") and previous is not None and previous.get("tool_calls"):
            previous["tool_calls"] += message["tool_calls"]  # one assistant turn, many calls
        else:
            messages.append(message)
        items.append(listed)
    return messages, items


def _shown(kind: Any) -> str:
    return shown(kind) if isinstance(kind, str) else "none"


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A finished response's output items as the chat messages that continue its conversation."""
    text = "".join(
        part.get("text", "")
        for item in output
        if item.get("type") == "message"
        for part in item.get("content", [])
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item.get("type") == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return [message]
