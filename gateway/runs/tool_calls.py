"""The tool-call stage: a model's tool calls reach clients whole and valid, or the run fails.

Upstreams stream a call in fragments (id and name first, `arguments` in pieces; an
OpenAI-compatible server may interleave calls, and a choice may make several). The stage holds
every fragment back until its choice finishes, then checks each call (a tool the request offers
and `tool_choice` allows, arguments that are one JSON object passing the tool's
`function.parameters` schema) and releases each as one `ToolCallDelta` carrying its id, its name
and its whole arguments string, exactly as the model wrote it, followed by the choice's `Finish`
with reason `tool_calls`. A call that fails the check ends the run with one `ErrorEvent`
(`invalid_tool_call`) and nothing of that choice's calls: a client never sees half a call.

NOTE: a call is judged when its choice finishes, not when its arguments first parse: a JSON
prefix can already be valid (`12` of `123`), and interleaved calls give no other sign that one
is over.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from jsonschema import SchemaError
from jsonschema.exceptions import best_match
from jsonschema.protocols import Validator
from jsonschema.validators import Draft202012Validator, validator_for
from referencing import Registry
from referencing.exceptions import Unresolvable
from referencing.jsonschema import DRAFT202012, specification_with

from adapters.events import ErrorEvent, Event, Finish, ToolCallDelta
from adapters.requests import ChatRequest
from gateway.http.errors import invalid_request

INVALID_TOOL_CALL = "invalid_tool_call"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # what a tool's name may be: safe to repeat
_REF_KEYS = ("$ref", "$dynamicRef")
# NOTE: jsonschema checks and applies a schema recursively, several frames per level; past this
# many levels of JSON nesting a schema would exhaust Python's stack instead of being judged.
MAX_SCHEMA_DEPTH = 64
# NOTE: an empty registry, so a `$ref` never makes the gateway fetch a URL (jsonschema's default
# registry would retrieve remote references).
_NO_RETRIEVAL: Registry = Registry()


# -- the tools' schemas ----------------------------------------------------------------------------


def _refs(schema: Any) -> Iterator[str]:
    """Every `$ref`/`$dynamicRef` in a schema, however deep."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in _REF_KEYS and isinstance(value, str):
                    yield value
                else:
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)


def _depth(schema: Any) -> int:
    """How deeply a schema's objects and arrays nest (a scalar is 0)."""
    deepest = 0
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
    return deepest


def compile_schema(schema: dict[str, Any]) -> Validator:
    """A validator for one tool's parameters, in the draft its `$schema` names (2020-12 when it
    names none); raises SchemaError when the schema is not a valid JSON Schema."""
    dialect = schema.get("$schema")
    # NOTE: checked before jsonschema looks the dialect up, which hashes and parses it as a URI
    # (a TypeError or AttributeError for anything but a string)
    if "$schema" in schema and not isinstance(dialect, str):
        raise SchemaError("'$schema' must be a string", validator="type", path=["$schema"])
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise SchemaError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    cls = validator_for(schema, default=Draft202012Validator)
    cls.check_schema(schema)
    spec = specification_with(dialect or "", default=DRAFT202012)
    resolver = _NO_RETRIEVAL.resolver_with_root(spec.create_resource(schema))
    for ref in _refs(schema):
        if not ref.startswith("#"):
            raise SchemaError(f"'$ref' {ref!r} is not local: only '#…' references are allowed")
        try:
            resolver.lookup(ref)
        except Unresolvable as exc:
            raise SchemaError(f"'$ref' {ref!r} does not resolve") from exc
    return cls(schema, registry=_NO_RETRIEVAL)


def check_tool_parameters(tools: list[dict[str, Any]]) -> None:
    """Refuse (400, naming `tools[i].function.parameters`) a tool whose parameters are not a
    valid JSON Schema object, so a run never starts with a schema that cannot judge a call.
    Called by `gateway.protocol` after it checked each tool's shape."""
    for i, tool in enumerate(tools):
        schema = tool["function"].get("parameters")
        if schema is None:
            continue
        param = f"tools[{i}].function.parameters"
        if not isinstance(schema, dict):
            raise invalid_request(
                param, f"Invalid '{param}': expected a JSON Schema object.", code="invalid_type"
            )
        try:
            compile_schema(schema)
        except SchemaError as exc:
            where = "/".join(str(p) for p in exc.path)
            what = f"at {where}: {exc.message[:200]}" if where else exc.message[:200]
            raise invalid_request(
                param,
                f"Invalid '{param}': not a valid JSON Schema ({what}).",
                code="invalid_tool_schema",
            ) from exc


# -- checking one call -----------------------------------------------------------------------------


class BadToolCall(ValueError):
    """A call the stage will not release; the message is ours and names only the tool."""


@dataclass(slots=True)
class _Call:
    """One call as its fragments arrive."""

    id: str | None = None
    name: str = ""
    arguments: list[str] = field(default_factory=list)


def _shown(name: str) -> str:
    """The tool's name as an error message may quote it (a model's name could be anything)."""
    return f"'{name}'" if _NAME.fullmatch(name) else "with an invalid name"


def _check_arguments(name: str, text: str, validator: Validator | None) -> None:
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise BadToolCall(
            f"The model called tool '{name}' with arguments that are not valid JSON."
        ) from None
    if not isinstance(value, dict):
        raise BadToolCall(f"The model called tool '{name}' with arguments that are not an object.")
    if validator is None:
        return
    try:
        error = best_match(validator.iter_errors(value))
    except Unresolvable:  # guarded at parse time; a nested `$id` can still defeat that check
        raise BadToolCall(f"Tool '{name}' has a parameters schema that cannot be used.") from None
    except RecursionError:  # a `$ref` cycle, or a recursive schema meeting deep arguments
        raise BadToolCall(
            f"The model called tool '{name}' with arguments its parameters schema cannot judge "
            "(a '$ref' cycle, or arguments nested too deeply)."
        ) from None
    if error is not None:
        # NOTE: the schema path comes from the request's own schema; the instance path and
        # jsonschema's message would repeat the model's keys and values.
        where = "/".join(str(p) for p in error.schema_path) or "the root"
        raise BadToolCall(
            f"The model called tool '{name}' with arguments that do not match its parameters "
            f"schema (the '{error.validator}' rule at {where})."
        )


class ToolCallStage:
    """Holds a run's tool-call fragments until each call is whole and valid (see the module)."""

    def __init__(self, validators: dict[str, Validator | None], allowed: frozenset[str]) -> None:
        """`validators`: per offered tool, its parameters' validator (None: no schema);
        `allowed`: the names `tool_choice` lets the model call."""
        self.validators = validators
        self.allowed = allowed
        self.calls: dict[int, dict[int, _Call]] = {}  # choice → call_index → call
        self.failed = False
        # NOTE: never set: a bad call is a failed run (the ErrorEvent it releases), not a
        # choice this stage ended by itself
        self.stop_source: str | None = None

    async def feed(self, events: list[Event]) -> list[Event]:
        """Everything but tool-call fragments passes at once (text too); a choice's calls pass
        with its Finish. After a bad call, nothing passes."""
        if self.failed:
            return []
        out: list[Event] = []
        for event in events:
            kind = type(event)
            if kind is ToolCallDelta:
                self._add(event)
            elif kind is Finish and not self.calls.get(event.index):
                self.calls.pop(event.index, None)
                out.append(event)  # no calls: it passes as it came (its stop string too)
            elif kind is Finish:
                out += self._close(event.index, event.reason)
                if self.failed:
                    break
            else:
                out.append(event)
        return out

    async def finish(self) -> list[Event]:
        """The upstream ended without finishing some choices: their calls are whole now."""
        out: list[Event] = []
        for index in sorted(self.calls):
            if self.failed:
                break
            out += self._close(index, "tool_calls")
        return out

    def _add(self, delta: ToolCallDelta) -> None:
        call = self.calls.setdefault(delta.index, {}).setdefault(delta.call_index, _Call())
        if delta.id is not None and call.id is None:
            call.id = delta.id
        if delta.name is not None:
            call.name += delta.name
        if delta.arguments:
            call.arguments.append(delta.arguments)

    def _close(self, index: int, reason: str) -> list[Event]:
        """A choice finished: its calls, each whole, then its Finish; or the run's error."""
        calls = self.calls.pop(index, None)
        if not calls:
            return [Finish(reason, index)]
        try:
            released = [self._checked(k, calls[c], index) for k, c in enumerate(sorted(calls))]
        except BadToolCall as exc:
            self.failed = True
            self.calls.clear()
            return [ErrorEvent(INVALID_TOOL_CALL, str(exc), details={"choice": index})]
        # OpenAI says `tool_calls` for a choice that made calls; a filtered one stays filtered
        final = reason if reason == "content_filter" else "tool_calls"
        return [*released, Finish(final, index)]

    def _checked(self, position: int, call: _Call, index: int) -> ToolCallDelta:
        """The call as one delta (numbered 0, 1, … in the order of the model's indexes)."""
        name = call.name
        if not name:
            raise BadToolCall("The model made a tool call without a function name.")
        if name not in self.validators:
            raise BadToolCall(f"The model called a tool {_shown(name)} the request does not offer.")
        if name not in self.allowed:
            raise BadToolCall(f"The model called tool '{name}', which 'tool_choice' rules out.")
        arguments = "".join(call.arguments)
        if not arguments.strip():  # some upstreams send nothing for a call without parameters
            arguments = "{}"
        _check_arguments(name, arguments, self.validators[name])
        call_id = call.id or f"call_{uuid.uuid4().hex[:24]}"
        return ToolCallDelta(position, arguments, call_id, name, index)


def _allowed(chat: ChatRequest, names: list[str]) -> frozenset[str]:
    choice = chat.tool_choice
    if choice == "none":
        return frozenset()
    if isinstance(choice, dict):
        return frozenset({choice["function"]["name"]}) & frozenset(names)
    return frozenset(names)


def tool_call_stage(chat: ChatRequest) -> ToolCallStage | None:
    """The stage for a request that offers tools (compiling each schema once for the run);
    None when it offers none, so a plain chat pays nothing."""
    if not chat.tools:
        return None
    validators: dict[str, Validator | None] = {}
    for tool in chat.tools:
        function = tool["function"]
        schema = function.get("parameters")
        validators[function["name"]] = None if schema is None else compile_schema(schema)
    return ToolCallStage(validators, _allowed(chat, list(validators)))
