"""What a request asks of the output's shape: a response format and the tools it may call.

Torch- and grammar-free, so the gateway's worker adapter builds these and the worker server parses
them with the same code (wire/generate_body.py serialises them). Parsing checks the wire
shape and names the field (`InvalidParam`); whether a schema can be enforced is the grammar
compiler's business (workers/grammar.py), which needs the model's tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wire.limits import shown
from wire.sampling_params import InvalidParam

JSON_FORMATS = ("json_object", "json_schema")
TOOL_CHOICE_MODES = ("auto", "none", "required")


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """`json_object` (any JSON object) or `json_schema` (`schema` enforced; `strict` is kept for
    the wire: the worker always enforces the schema it is given)."""

    type: str
    schema: dict[str, Any] | None = None
    name: str | None = None
    strict: bool | None = None

    def wire(self) -> dict[str, Any]:
        if self.type == "json_object":
            return {"type": "json_object"}
        spec: dict[str, Any] = {"name": self.name, "schema": self.schema}
        if self.strict is not None:
            spec["strict"] = self.strict
        return {"type": "json_schema", "json_schema": spec}


@dataclass(frozen=True, slots=True)
class Tool:
    """One function the model may call; `parameters` is its arguments' JSON Schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    def wire(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """The tools and the choice: `auto`, `none`, `required`, or one function's name (`named`)."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    named: str | None = None

    @property
    def offered(self) -> bool:
        """Whether the model sees the tools and its calls are parsed (not with `none`)."""
        return self.choice != "none"

    @property
    def forced(self) -> tuple[Tool, ...]:
        """The tools one of which must be called (enforced by a grammar); empty when not forced."""
        if self.named is not None:
            return tuple(t for t in self.tools if t.name == self.named)
        return self.tools if self.choice == "required" else ()

    def wire_choice(self) -> str | dict[str, Any]:
        if self.named is not None:
            return {"type": "function", "function": {"name": self.named}}
        return self.choice


def parse_response_format(value: Any) -> ResponseFormat | None:
    """None for absent or `text`; raises InvalidParam naming the bad field."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidParam("response_format", "response_format must be an object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind != "json_schema":
        raise InvalidParam(
            "response_format.type", "response_format.type must be text, json_object or json_schema"
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidParam("response_format.json_schema", "json_schema must be an object")
    name, schema, strict = spec.get("name"), spec.get("schema", {}), spec.get("strict")
    if not isinstance(name, str) or not name:
        raise InvalidParam("response_format.json_schema.name", "json_schema.name is required")
    if not isinstance(schema, dict):
        raise InvalidParam(
            "response_format.json_schema.schema", "json_schema.schema must be an object"
        )
    if strict is not None and not isinstance(strict, bool):
        raise InvalidParam("response_format.json_schema.strict", "strict must be a boolean")
    return ResponseFormat("json_schema", schema, name, strict)


def _tool(i: int, value: Any) -> Tool:
    where = f"tools[{i}]"
    function = value.get("function") if isinstance(value, dict) else None
    if (
        not isinstance(value, dict)
        or value.get("type") != "function"
        or not isinstance(function, dict)
    ):
        raise InvalidParam(where, f"{where} must be an object with type function and a function")
    name, description = function.get("name"), function.get("description")
    parameters = function.get("parameters")
    if not isinstance(name, str) or not name:
        raise InvalidParam(f"{where}.function.name", f"{where}.function.name is required")
    if description is not None and not isinstance(description, str):
        raise InvalidParam(f"{where}.function.description", "description must be a string")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidParam(f"{where}.function.parameters", "parameters must be an object")
    return Tool(name, description, parameters)


def parse_tools(tools: Any, tool_choice: Any) -> ToolSpec | None:
    """None when no tools are given; raises InvalidParam naming the bad field."""
    if tool_choice is not None and not tools:
        raise InvalidParam("tool_choice", "tool_choice is only allowed when tools are given")
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools:
        raise InvalidParam("tools", "tools must be a non-empty list")
    parsed = tuple(_tool(i, t) for i, t in enumerate(tools))
    if len({t.name for t in parsed}) != len(parsed):
        raise InvalidParam("tools", "tool names must be unique")
    if tool_choice is None or tool_choice in TOOL_CHOICE_MODES:
        return ToolSpec(parsed, tool_choice or "auto")
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or tool_choice.get("type") != "function":
        raise InvalidParam(
            "tool_choice",
            "tool_choice must be auto, none, required or {type: function, function: {name}}",
        )
    if name not in {t.name for t in parsed}:
        raise InvalidParam("tool_choice.function.name", f"no tool is named {shown(name)}")
    return ToolSpec(parsed, "required", name)
