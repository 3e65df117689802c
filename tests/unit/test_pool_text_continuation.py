"""A run streamed by a member without token ids (an OpenAI-compatible server) that fails
mid-stream goes on on another member from its text (design §6): the next member is asked for
the conversation with the text so far as an open assistant message, for `max_tokens` less what
was generated, and its usage is put back in the run's terms. Over fake members that generate
like a greedy server: always the same tokens, going on from an open assistant message."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

from adapters.base import BackendFailed
from adapters.events import Accepted, ErrorEvent, Event, Finish, TextDelta, ToolCallDelta, Usage
from adapters.pool import PoolAdapter
from adapters.pool_continuation import continued_from_text
from adapters.requests import ChatRequest, Message
from tests.support.waiting import until

TOKENS = list(range(100, 120))
WHOLE = "".join(f"<{t}>" for t in TOKENS)
PROMPT_TOKENS = 5


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def request(**more) -> ChatRequest:
    return ChatRequest("m", [Message("user", "go")], max_tokens=len(TOKENS), **more)


class TextMember:
    """An OpenAI-compatible server as the pool sees one: text without ids, no stats; it goes on
    from an open assistant message, and can be made to die or fall silent in one stream."""

    continues_text = True

    def __init__(self, name: str, *, die_after: int | None = None, call: bool = False) -> None:
        self.name = name
        self.die_after = die_after
        self.silent_after: int | None = None
        self.went_silent = asyncio.Event()
        self.call = call  # its first output is (the start of) a tool call
        self.asked: list[ChatRequest] = []

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def ready(self) -> bool:
        return True

    def unsupported_param(self, request: ChatRequest) -> str | None:
        return None

    async def stream(self, request: ChatRequest, request_id: str) -> AsyncIterator[list[Event]]:
        self.asked.append(request)
        done = 0
        if request.continue_final_message:
            done = len(re.findall(r"<\d+>", request.messages[-1].content or ""))
        yield [Accepted()]
        if self.call:
            yield [ToolCallDelta(0, '{"ci', "call_1", "f")]
        todo = TOKENS[done:][: request.max_tokens]
        for sent, token in enumerate(todo):
            if sent == self.die_after:  # once
                self.die_after = None
                raise BackendFailed("The connection to the upstream model server was lost.")
            if sent == self.silent_after:
                self.silent_after = None
                self.went_silent.set()
                await asyncio.Event().wait()
            yield [TextDelta(f"<{token}>")]
        yield [Finish("length"), Usage(PROMPT_TOKENS + done, len(todo))]

    async def abort(self, request_id: str) -> bool:
        return False


async def collect(pool: PoolAdapter, req: ChatRequest | None = None) -> list[Event]:
    events: list[Event] = []
    async for batch in pool.stream(req or request(), "r1"):
        events += batch
    return events


def text(events: list[Event]) -> str:
    return "".join(e.text for e in events if type(e) is TextDelta)


def first_then(pool: PoolAdapter) -> None:
    """Member 0 gets the run first; a continuation goes wherever the pool sends it."""
    choose = pool.choose
    pool.choose = lambda req, tried, run=None: (
        choose(req, tried, run) if run is not None or 0 in tried else 0
    )


async def test_a_cut_run_goes_on_from_its_text_on_another_member():
    cut, other = TextMember("cut", die_after=5), TextMember("other")
    pool = PoolAdapter([cut, other])
    first_then(pool)
    events = await collect(pool)
    assert text(events) == WHOLE  # nothing lost, nothing repeated
    (asked,) = other.asked
    assert asked.continue_final_message
    assert asked.messages[-1] == Message("assistant", WHOLE[: len("<100>") * 5])
    assert asked.messages[:-1] == request().messages
    assert asked.max_tokens == len(TOKENS) - 5
    assert [e for e in events if type(e) is Usage] == [Usage(PROMPT_TOKENS, len(TOKENS))]
    assert pool.migrations == {"continued": 1}


async def test_a_member_silent_mid_stream_has_its_run_moved_at_a_probe_round():
    quiet, other = TextMember("quiet"), TextMember("other")
    quiet.silent_after = 3
    clock = Clock()
    pool = PoolAdapter([quiet, other], stall_timeout=10.0, clock=clock)
    first_then(pool)
    answer = asyncio.create_task(collect(pool))
    await until(quiet.went_silent.is_set, "the member to fall silent mid-stream")
    await pool.ready()
    assert not answer.done()  # silent, but not for the stall timeout yet
    clock.now += 10.0
    await pool.ready()  # the probe round that finds it silent too long
    events = await asyncio.wait_for(answer, 10)
    assert text(events) == WHOLE
    assert other.asked[0].max_tokens == len(TOKENS) - 3


async def test_a_client_open_assistant_message_grows_by_the_text():
    original = request(continue_final_message=True)
    original.messages.append(Message("assistant", "Once"))
    asked = continued_from_text(original, " upon", 1)
    assert asked.messages[-1] == Message("assistant", "Once upon")
    assert len(asked.messages) == len(original.messages)
    assert asked.max_tokens == len(TOKENS) - 1


async def test_a_half_written_tool_call_is_not_continued_from_text():
    cut, other = TextMember("cut", die_after=2, call=True), TextMember("other")
    pool = PoolAdapter([cut, other])
    first_then(pool)
    events = await collect(pool)
    assert [e.code for e in events if type(e) is ErrorEvent] == ["worker_failed"]
    assert other.asked == []
    assert pool.migrations == {"not_continuable": 1}


async def test_a_grammar_half_written_is_not_continued_from_text():
    cut, other = TextMember("cut", die_after=2), TextMember("other")
    pool = PoolAdapter([cut, other])
    first_then(pool)
    events = await collect(pool, request(response_format={"type": "json_object"}))
    assert [e.code for e in events if type(e) is ErrorEvent] == ["worker_failed"]
    assert other.asked == []


async def test_no_member_that_continues_text_means_not_continuable_at_once():
    cut, other = TextMember("cut", die_after=2), TextMember("other")
    cut.continues_text = other.continues_text = False  # servers without continue_final_message
    pool = PoolAdapter([cut, other], migration_wait=60)
    first_then(pool)
    events = await asyncio.wait_for(collect(pool), 10)  # no wait for a member that never comes
    assert [e.code for e in events if type(e) is ErrorEvent] == ["worker_failed"]
    assert pool.migrations == {"not_continuable": 1}
