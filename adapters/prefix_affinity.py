"""Prefix affinity: requests whose prompts share a prefix go to the member that already holds it
in its prefix cache.

A prompt's key is a chain of hashes over its whole rendered conversation in blocks of
`BLOCK_CHARS` characters (role and content of every message, in order; not the first message
only), so a growing conversation keeps finding the member that served its earlier turns. The
map remembers, for each block hash, the member last routed a prompt holding that block; it is
bounded (least recently used blocks go first) and local to this replica.
"""

from __future__ import annotations

from collections import OrderedDict

from adapters.requests import ChatRequest

BLOCK_CHARS = 256


def prefix_keys(request: ChatRequest) -> list[int]:
    """A hash per whole block of the rendered conversation, each chained on the one before."""
    text = "".join(
        f"{m.role}\x00{m.content or ''}\x00{m.tool_calls or ''}\x00" for m in request.messages
    )
    keys, chained = [], 0
    for end in range(BLOCK_CHARS, len(text) + 1, BLOCK_CHARS):
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
