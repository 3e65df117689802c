"""Tool turns as a chat template sees them: passed through for a template that knows tools, or
written out in the Hermes convention (Qwen2's system prompt) for one that does not.

The model's calls come back in the same `<tool_call>` markup (tool_parser.py parses them), so a
conversation round-trips: an assistant message's `tool_calls` render as the blocks the model
would have written, a `tool` message's result as a `<tool_response>` block.
"""

from __future__ import annotations

import json
from typing import Any

from wire.output_spec import ToolSpec
from workers.tool_parser import CLOSE, OPEN

_HERMES_SYSTEM = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def _arguments(raw: str) -> Any:
    """A call's arguments as an object where they parse (templates `tojson` them)."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template that knows tools: calls' arguments as objects, as transformers expects."""
    out = []
    for m in messages:
        if "tool_calls" in m:
            calls = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": _arguments(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def tools_system_prompt(tools: ToolSpec) -> str:
    """The Hermes tools block, and which call is required when one is."""
    listed = "\n".join(json.dumps(t.wire(), ensure_ascii=False) for t in tools.tools)
    text = _HERMES_SYSTEM.format(tools=listed)
    if tools.named is not None:
        text += f"\n\nYou must call the function {tools.named}."
    elif tools.choice == "required":
        text += "\n\nYou must call at least one of these functions."
    return text


def _call_block(call: dict[str, Any]) -> str:
    function = call["function"]
    body = {"name": function["name"], "arguments": _arguments(function["arguments"])}
    return f"{OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{CLOSE}"


def _hermes_message(m: dict[str, Any]) -> dict[str, Any]:
    if m["role"] == "tool":
        return {"role": "tool", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
    if "tool_calls" in m:
        blocks = [_call_block(c) for c in m["tool_calls"]]
        content = "\n".join([m["content"], *blocks] if m["content"] else blocks)
        return {"role": "assistant", "content": content}
    return {"role": m["role"], "content": m["content"]}


def hermes_messages(
    messages: list[dict[str, Any]], offered: ToolSpec | None
) -> list[dict[str, Any]]:
    """For a template that does not know tools: everything written into plain messages."""
    out = [_hermes_message(m) for m in messages]
    if offered is None:
        return out
    block = tools_system_prompt(offered)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out
