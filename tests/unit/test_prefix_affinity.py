"""Prefix affinity keys follow the workers' prefix caches (design §6): a tenant's blocks are its
own, a declared-shared system prompt is every tenant's, tools rendered into the prompt count."""

from __future__ import annotations

from dataclasses import replace

from adapters.pool import PoolAdapter
from adapters.prefix_affinity import BLOCK_CHARS, prefix_keys
from adapters.requests import ChatRequest, Message
from tests.unit.test_pool import Member, run

SYSTEM = "You are a careful assistant who answers in full sentences. " * 20  # several blocks
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


def chat(question: str, salt: str | None = "tenant-a", **fields) -> ChatRequest:
    messages = [Message("system", SYSTEM), Message("user", question)]
    return ChatRequest(model="m", messages=messages, cache_salt=salt, **fields)


def shared_blocks(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def test_the_key_starts_from_the_tenants_salt():
    a = prefix_keys(chat("What is a B-tree?"))
    assert prefix_keys(chat("What is a B-tree?")) == a
    assert len(a) >= 4
    other = prefix_keys(chat("What is a B-tree?", salt="tenant-b"))
    assert set(a).isdisjoint(other)  # no block of one tenant is another's
    assert set(a).isdisjoint(prefix_keys(chat("What is a B-tree?", salt=None)))


def test_a_declared_shared_system_prompt_is_every_tenants_and_the_rest_their_own():
    a = prefix_keys(chat("What is a B-tree?", shared_system_prompt=True))
    b = prefix_keys(chat("What is a B-tree?", salt="tenant-b", shared_system_prompt=True))
    whole = len(f"system\x00{SYSTEM}\x00\x00") // BLOCK_CHARS
    assert shared_blocks(a, b) == whole  # the blocks wholly inside the system prompt
    assert set(a[whole:]).isdisjoint(b[whole:])
    # not declared shared: the same tenant's prompt keys differently from the start
    assert prefix_keys(chat("What is a B-tree?"))[0] != a[0]


def test_tools_shown_to_the_model_change_the_key_and_the_output_format_does_not():
    plain = prefix_keys(chat("Look it up."))
    with_tools = prefix_keys(chat("Look it up.", tools=TOOLS))
    assert shared_blocks(plain, with_tools) == 0  # rendered first, in the system turn
    assert prefix_keys(chat("Look it up.", tools=TOOLS, tool_choice="none")) == plain
    json_out = chat("Look it up.", response_format={"type": "json_object"})
    assert prefix_keys(json_out) == plain
    shared = prefix_keys(chat("Look it up.", tools=TOOLS, shared_system_prompt=True))
    assert shared == with_tools  # tools written into the system turn: nothing is shared


async def test_another_tenants_identical_prompt_neither_follows_nor_takes_over_the_blocks():
    a, b = Member("a"), Member("b")
    pool = PoolAdapter([a, b])
    question = chat("What is a B-tree?")
    first = await run(pool, question, "r1")
    # tenant B's identical prompt can hit nothing on A's member: load decides (the other one)
    other = await run(pool, replace(question, cache_salt="tenant-b"), "r2")
    assert other != first
    # and tenant A's blocks still lead to A's member, against the turn-taking of equal loads
    again = [await run(pool, chat(f"Question {i}"), f"q{i}") for i in range(3)]
    assert again == [first] * 3
    again_b = [await run(pool, chat(f"Q {i}", salt="tenant-b"), f"b{i}") for i in range(3)]
    assert again_b == [other] * 3
