"""The Anthropic Messages request schema, as a chat request on the same runs.

A Messages body is checked for its own fields here (`system`, content blocks, `tool_use` and
`tool_result`, `stop_sequences`, `tool_choice`, `metadata.user_id`, …) and rewritten as the chat
body it asks for, which then goes through the one chat parser (gateway/protocol.py): one set of
checks for sampling, tools and schemas. An error that parser raises names a chat field;
`renamed` gives it back the Messages name. A known field sluicegate cannot honour (images,
documents, thinking, cache_control) is a 400 naming it; an unknown field is a 400 too,
as Anthropic's API answers.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from adapters.requests import ChatRequest
from gateway.field_check import check_fields
from gateway.http.errors import APIError, invalid_request
from gateway.protocol import MAX_INT64, parse_chat_request
from gateway.runs.admission import prompt_estimate
from wire.limits import shown

HONOURED = frozenset(
    {
        "model",
        "messages",
        "system",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop_sequences",
        "stream",
        "tools",
        "tool_choice",
        "metadata",
    }
)
# Known Messages fields with no meaning here: refused unless null (or their neutral value).
REFUSED = {
    "thinking": None,
    "service_tier": "auto",
    "container": None,
    "mcp_servers": None,
    "context_management": None,
}
# Content block types Anthropic knows that no backend here can take.
REFUSED_BLOCKS = frozenset(
    {
        "image",
        "document",
        "search_result",
        "thinking",
        "redacted_thinking",
        "server_tool_use",
        "web_search_tool_result",
        "container_upload",
    }
)
ROLES = frozenset({"user", "assistant"})

# chat field → Messages field, for errors the chat parser and the backend checks raise
_RENAMES = (
    (re.compile(r"\bmax_completion_tokens\b"), "max_tokens"),
    (re.compile(r"(?<=')stop\b"), "stop_sequences"),
    (re.compile(r"\b(tools\[\d+\])\.function\.parameters\b"), r"\1.input_schema"),
    (re.compile(r"\b(tools\[\d+\])\.function\b"), r"\1"),
    (re.compile(r"\btool_choice\.function\.name\b"), "tool_choice.name"),
    (re.compile(r"'user'"), "'metadata.user_id'"),
)


def renamed(exc: APIError) -> APIError:
    """The error with the Messages names of the fields it names."""
    for pattern, name in _RENAMES:
        if exc.param is not None:
            exc.param = pattern.sub(name, exc.param)
        exc.message = pattern.sub(name, exc.message)
    if exc.param in ("user", "stop"):
        exc.param = {"user": "metadata.user_id", "stop": "stop_sequences"}[exc.param]
    return exc


def _unsupported(param: str, what: str | None = None) -> APIError:
    return invalid_request(
        param,
        f"'{param}' is not supported by sluicegate{': ' + what if what else ''}.",
        code="unsupported_parameter",
    )


def _check_fields(body: dict[str, Any]) -> None:
    check_fields(body, HONOURED, REFUSED, lambda name: f"{name}: Extra inputs are not permitted.")


def _block_type(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise invalid_request(f"{where}.type", f"'{where}' must be an object with a 'type'.")
    if kind in REFUSED_BLOCKS:
        raise _unsupported(f"{where}.type", f"{shown(kind)} content blocks are not supported")
    if block.get("cache_control") is not None:
        raise _unsupported(f"{where}.cache_control", "prompt caching here is automatic")
    return kind


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid_request(f"{where}.text", f"'{where}.text' must be a string.")
    if block.get("citations"):
        raise _unsupported(f"{where}.citations")
    return text


def _texts(content: Any, where: str) -> str:
    """A string, or text blocks joined (a system prompt, a tool result)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_request(where, f"'{where}' must be a string or an array of blocks.")
    parts = []
    for j, block in enumerate(content):
        kind = _block_type(block, f"{where}[{j}]")
        if kind != "text":
            raise invalid_request(
                f"{where}[{j}].type", f"'{where}[{j}]' must be a 'text' block, not {shown(kind)}."
            )
        parts.append(_text(block, f"{where}[{j}]"))
    return "".join(parts)


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, name, args = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, dict):
        raise invalid_request(
            where, f"'{where}' needs a string 'id' and 'name' and an object 'input'."
        )
    arguments = orjson.dumps(args).decode()
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise invalid_request(f"{where}.tool_use_id", f"'{where}.tool_use_id' must be a string.")
    content = block.get("content", "")
    text = _texts(content, f"{where}.content")
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _message(i: int, raw: Any) -> list[dict[str, Any]]:
    """The chat messages one Messages turn is: tool results become `tool` messages (first, as
    the chat's tool turns come right after the assistant's calls), text the turn's content,
    `tool_use` blocks the assistant's tool calls."""
    where = f"messages[{i}]"
    if not isinstance(raw, dict) or raw.get("role") not in ROLES:
        raise invalid_request(f"{where}.role", f"'{where}.role' must be 'user' or 'assistant'.")
    role, content = raw["role"], raw.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid_request(
            f"{where}.content", f"'{where}.content' must be a string or an array of blocks."
        )
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        here = f"{where}.content[{j}]"
        kind = _block_type(block, here)
        if kind == "text":
            texts.append(_text(block, here))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_call(block, here))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, here))
        else:
            raise invalid_request(
                f"{here}.type", f"A {shown(kind)} block is not allowed in a {role} message."
            )
    out = list(results)
    if calls:
        out.append({"role": role, "content": "".join(texts) or None, "tool_calls": calls})
    elif texts or not results:
        out.append({"role": role, "content": "".join(texts)})
    return out


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise invalid_request("messages", "'messages' must be a non-empty array.")
    return [m for i, turn in enumerate(raw) for m in _message(i, turn)]


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise invalid_request("tools", "'tools' must be an array.")
    tools = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "custom") not in ("custom", None):
            raise _unsupported(f"{where}.type", "only custom (client) tools are")
        if tool.get("cache_control") is not None:
            raise _unsupported(f"{where}.cache_control", "prompt caching here is automatic")
        function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if function["parameters"] is None:
            raise invalid_request(
                f"{where}.input_schema",
                f"Missing required parameter: '{where}.input_schema'.",
                code="missing_required_parameter",
            )
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(raw: Any) -> Any:
    """`auto`, `any` (the chat's `required`), `tool` (a named function) or `none`."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise invalid_request("tool_choice", "'tool_choice' must be an object.")
    kind = raw.get("type")
    if raw.get("disable_parallel_tool_use"):
        raise _unsupported(
            "tool_choice.disable_parallel_tool_use", "a model here may call several tools"
        )
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        name = raw.get("name")
        if not isinstance(name, str) or not name:
            raise invalid_request(
                "tool_choice.name",
                "Missing required parameter: 'tool_choice.name'.",
                code="missing_required_parameter",
            )
        return {"type": "function", "function": {"name": name}}
    raise invalid_request(
        "tool_choice.type", "'tool_choice.type' must be 'auto', 'any', 'tool' or 'none'."
    )


def _user(metadata: Any) -> str | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise invalid_request("metadata", "'metadata' must be an object.")
    for key in metadata:
        if key != "user_id":
            param = f"metadata.{key}" if len(key) <= 40 else "metadata"
            raise invalid_request(param, f"{shown(key)}: Extra inputs are not permitted.")
    user = metadata.get("user_id")
    if user is not None and not isinstance(user, str):
        raise invalid_request("metadata.user_id", "'metadata.user_id' must be a string.")
    return user


def _top_k(value: Any) -> int:
    """0 (off) when absent; the chat parser knows no top_k, so it is checked here."""
    if value is None:
        return 0
    if type(value) is float and value.is_integer():  # JSON's 35.0 is an integer too
        value = int(value)
    if type(value) is not int or not 0 <= value <= MAX_INT64:
        raise invalid_request("top_k", "top_k: must be a non-negative integer.")
    return value


def messages_request(body: Any) -> tuple[dict[str, Any], ChatRequest]:
    """(the chat body, the chat request) a Messages body asks for; raises an APIError naming
    the first bad field, by its chat name where the chat parser found it (see `renamed`)."""
    chat_json = chat_body(body)
    chat = parse_chat_request(chat_json)
    chat.top_k = chat_json.get("top_k", 0)
    chat.usage_on_open = prompt_estimate(chat)  # message_start's input_tokens, at the latest
    return chat_json, chat


def chat_body(body: Any) -> dict[str, Any]:
    """The chat body a Messages body asks for; raises an APIError naming the first bad field
    by its Messages name (the chat parser's own errors go through `renamed`)."""
    if not isinstance(body, dict):
        raise invalid_request(None, "The request body must be a JSON object.", code="invalid_type")
    _check_fields(body)
    if body.get("max_tokens") is None:
        raise invalid_request(
            "max_tokens", "max_tokens: Field required", code="missing_required_parameter"
        )
    system = body.get("system")
    messages = _messages(body.get("messages"))
    if system is not None:
        messages.insert(0, {"role": "system", "content": _texts(system, "system")})
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid_request("stream", "'stream' must be a boolean.", code="invalid_type")
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "messages": messages,
        "max_tokens": body["max_tokens"],
        "stream": bool(stream),
    }
    temperature = body.get("temperature")
    if isinstance(temperature, int | float) and not 0 <= temperature <= 1:
        raise invalid_request("temperature", "temperature: must be between 0 and 1.")
    optional = {
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "stop": body.get("stop_sequences"),
        "tools": _tools(body.get("tools")),
        "tool_choice": _tool_choice(body.get("tool_choice")),
        "user": _user(body.get("metadata")),
        # not a chat field (the chat parser ignores it): kept in the body so that an
        # Idempotency-Key's repeat with another top_k is told apart
        "top_k": _top_k(body.get("top_k")) or None,
    }
    chat.update({k: v for k, v in optional.items() if v is not None})
    return chat
