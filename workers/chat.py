"""Chat messages → prompt token ids, through the model's own chat template.

Rendering to text first and then tokenizing without special tokens is what transformers 5 wants
(the template already wrote BOS/ChatML markers). OpenAI's `developer` role is newer than most
templates; where a template does not know it, it becomes `system`.

Tools: a template that knows them (it mentions `tools`, as Qwen2's and Hermes' do) gets them and
the tool turns as transformers passes them, arguments as objects. Any other template gets the
Hermes convention written into the messages themselves (tool_prompt.py): the tools in the system
prompt, the assistant's calls as `<tool_call>` blocks, results as `<tool_response>` blocks.

A system prompt the gateway declares shared (design §5) is cached for every tenant: only the
prompt's leading tokens that are that message rendered alone (`shared_prefix_len`).
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from wire.output_spec import ToolSpec
from workers.tool_prompt import hermes_messages, template_messages


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, or the template refused them)."""


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return " ".join(template.values())
    return template or ""


def uses_tools(messages: list[dict[str, Any]], tools: ToolSpec | None) -> bool:
    """Whether the conversation involves tools (offered now, or called earlier)."""
    offered = tools is not None and tools.offered
    return offered or any("tool_calls" in m or "tool_call_id" in m for m in messages)


def render_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: ToolSpec | None = None,
    continue_final: bool = False,
) -> list[int]:
    """Prompt ids for `messages` (plain-string content; tool fields as wire/generate_body.py
    keeps them). With `tool_choice` none the tools are not shown to the model at all.
    `continue_final`: the last message is the assistant's, left open for the model to go on
    writing (no end-of-turn after it, no new turn begun)."""
    text = _render_text(tokenizer, messages, tools, generation_prompt=not continue_final)
    if continue_final:
        text = _open_final(tokenizer, messages, tools, text)
    return _tokens(tokenizer, text)


def raw_prompt(tokenizer: Any, text: str) -> list[int]:
    """Prompt ids for a raw prompt (a legacy completion's): the text tokenized as it is, with
    no chat template, and with the tokenizer's own special tokens (a BOS where it adds one), as
    vLLM's completions do."""
    return list(tokenizer(text)["input_ids"])


def _open_final(
    tokenizer: Any, messages: list[dict[str, Any]], tools: ToolSpec | None, text: str
) -> str:
    """The rendered conversation cut just after the last message's content, so the model goes
    on writing it. transformers' own `continue_final_message` does the same but strips the
    content's trailing whitespace, which would change what the model goes on from; a template
    that rewrites the content (trims it) gets the turn's header and the content as sent."""
    content = messages[-1].get("content") or ""
    at = text.rfind(content) if content else -1
    if at >= 0:
        return text[: at + len(content)]
    return _render_text(tokenizer, messages[:-1], tools, generation_prompt=True) + content


def shared_prefix_len(tokenizer: Any, messages: list[dict[str, Any]], prompt_ids: list[int]) -> int:
    """How many of `prompt_ids` are the first message alone: a system (or developer) message,
    rendered by itself from its role and text, without tools or a generation prompt. 0 when
    the prompt does not begin with exactly those tokens, or the first message is not one.

    NOTE: the tokens counted are exactly those of the message rendered from its role and text
    alone, so they may be cached for every tenant once the gateway vouches that the text is
    declared shared. Whatever else a request carries (tools written into the system turn, a
    `name`, the turns after it) either comes after them or makes the prompt differ from them,
    and then nothing is shared.
    """
    first = messages[0] if messages else None
    if first is None or first["role"] not in ("system", "developer"):
        return 0
    alone = [{"role": first["role"], "content": first["content"]}]
    try:
        ids = _tokens(tokenizer, _render_text(tokenizer, alone, None, generation_prompt=False))
    except ChatTemplateError:  # a template that will not render a system turn alone
        return 0
    return len(ids) if prompt_ids[: len(ids)] == ids else 0


def _render_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: ToolSpec | None,
    *,
    generation_prompt: bool,
) -> str:
    template = _template_text(tokenizer)
    if not template:
        raise ChatTemplateError("this model has no chat template")
    if "developer" not in template:
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    offered = tools if tools is not None and tools.offered else None
    kwargs: dict[str, Any] = {}
    if uses_tools(messages, tools):
        if "tools" in template:
            messages = template_messages(messages)
            if offered is not None:
                kwargs["tools"] = [t.wire() for t in offered.tools]
        else:
            messages = hermes_messages(messages, offered)
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )
    except (TemplateError, ValueError, TypeError, KeyError) as e:  # a 400 for the caller
        raise ChatTemplateError(f"the chat template rejected the messages: {e}") from None


def _tokens(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
