"""Chat messages → prompt token ids, through the model's own chat template.

Rendering to text first and then tokenizing without special tokens is what transformers 5 wants
(the template already wrote BOS/ChatML markers). OpenAI's `developer` role is newer than most
templates; where a template does not know it, it becomes `system`.
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, or the template refused them)."""


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return " ".join(template.values())
    return template or ""


def render_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Prompt ids for `messages` (each {"role", "content"} with plain-string content)."""
    template = _template_text(tokenizer)
    if not template:
        raise ChatTemplateError("this model has no chat template")
    if "developer" not in template:
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except (TemplateError, ValueError, TypeError, KeyError) as e:  # a 400 for the caller
        raise ChatTemplateError(f"the chat template rejected the messages: {e}") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
