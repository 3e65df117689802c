"""Prefix affinity: requests whose prompts share a prefix go to the member that already holds it
in its prefix cache.

A prompt's key is a chain of hashes over its whole rendered conversation in blocks of
`BLOCK_CHARS` characters (role and content of every message, in order; not the first message
only), so a growing conversation keeps finding the member that served its earlier turns. The
map remembers, for each block hash, the member last routed a prompt holding that block; it is
bounded (least recently used blocks go first) and local to this replica.

NOTE: the chain follows the workers' own (workers/block_manager.py `chain_parent`), so a key
only matches where a cache hit can: it starts from the request's `cache_salt` (a tenant's
blocks are its own, so another tenant's identical prompt is not sent after them, nor takes
their member over); a system prompt declared shared is chained from a constant of its own,
with the salt taken in after it, as every tenant shares those blocks. The tools a template
renders into the prompt (unless `tool_choice` is none) come first, as they do in the system
turn; `response_format` is a grammar on the output, not prompt text, and is left out.
"""

from __future__ import annotations

import json
from collections import OrderedDict

from adapters.requests import ChatRequest, Message

BLOCK_CHARS = 256
SHARED_START = hash(("shared_system_prompt",))


def _message_text(message: Message) -> str:
    return f"{message.role}\x00{message.content or ''}\x00{message.tool_calls or ''}\x00"


def _tools_text(request: ChatRequest) -> str:
    """The tools as the model sees them: none with `tool_choice` none."""
    if not request.tools or request.tool_choice == "none":
        return ""
    return json.dumps(request.tools, sort_keys=True, separators=(",", ":")) + "\x00"


def prefix_keys(request: ChatRequest) -> list[int]:
    """A hash per whole block of the rendered conversation, each chained on the one before."""
    tools = _tools_text(request)
    text = tools + "".join(_message_text(m) for m in request.messages)
    if request.prompt is not None:  # a legacy completion: its raw text is the prefix
        text = f"prompt\x00{request.prompt}"
    shared = 0  # the worker shares the system prompt rendered alone: not with tools in it
    if request.shared_system_prompt and request.messages and not tools:
        shared = len(_message_text(request.messages[0]))
    salt = ("cache_salt", request.cache_salt)
    keys, chained = [], SHARED_START if shared else hash(salt)
    for end in range(BLOCK_CHARS, len(text) + 1, BLOCK_CHARS):
        if shared and end > shared:  # the first block past the shared prompt takes the salt in
            chained, shared = hash((chained, salt)), 0
        chained = hash((chained, text[end - BLOCK_CHARS : end]))
        keys.append(chained)
    return keys


class PrefixAffinity:
    def __init__(self, capacity: int = 50_000) -> None:
        self.capacity = capacity
        self._owners: OrderedDict[int, int] = OrderedDict()  # block hash → member index

    def owners(self, keys: list[int]) -> list[int]:
        """The members holding this prompt's prefix, longest prefix first."""
        found: list[int] = []
        for key in reversed(keys):
            owner = self._owners.get(key)
            if owner is not None and owner not in found:
                found.append(owner)
        return found

    def remember(self, keys: list[int], member: int) -> None:
        for key in keys:
            self._owners[key] = member
            self._owners.move_to_end(key)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)
