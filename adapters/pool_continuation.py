"""What a run streamed from a pool member so far, so that another member can continue it
(design §6).

A member that dies or hangs mid-stream leaves the run with the text its client already has.
Our own workers send the token ids of every line (worker API v3), so the pool keeps the ids of
choice 0 as they pass and asks the next member for the same request with `continuation` set to
them: that worker prefills prompt + those tokens, replays them through its stop-string and
tool-call state, and generates on. The client's stream goes on with no gap and nothing repeated;
with greedy decoding the text equals an uninterrupted run's, and the usage the worker reports
counts both members' tokens.

An OpenAI-compatible member sends text without token ids. A run it streamed goes on from its
text instead: the next member (an OpenAI-compatible server that takes vLLM's
`continue_final_message`, or one of our workers) is asked for the same conversation with the
text so far as an open assistant message, and `max_tokens` less what was generated; the usage
it reports is put back in the run's terms (its prompt less the carried text's tokens, its
completion plus them). Runs that cannot be continued: more than one choice; a tool call or a
`response_format` grammar half written by a member without token ids; no member able to take
the continuation. A run cut before its first token (queued on the member) starts afresh on any
member.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from adapters.events import Accepted, Admitted, Event, Finish, TextDelta, ToolCallDelta, Usage
from adapters.requests import ChatRequest, Message

MAX_MIGRATIONS = 3  # members a run may move to before it is failed


@dataclass(slots=True)
class RunProgress:
    """One request's stream through the pool: what was passed on, and what to ask next."""

    original: ChatRequest
    ids: list[int] = field(default_factory=list)  # choice 0's token ids passed on
    started: bool = False  # a batch reached the run: a failure now is mid-stream
    traced: bool = True  # every token passed on came with its ids
    generated: bool = False  # a token of any choice passed on (before: any member may start it)
    finished: bool = False  # choice 0 finished: nothing is left to continue
    aborting: bool = False  # the run asked its member to stop: a failure now is no migration
    migrations: int = 0
    migrating: bool = False  # the member streaming now is continuing the run
    text: list[str] = field(default_factory=list)  # choice 0's text passed on
    tokens: int = 0  # choice 0's generated tokens passed on
    called: bool = False  # choice 0 passed on (part of) a tool call
    carried: int | None = None  # tokens the member now streaming was handed as text

    def can_continue_on(self, adapter: Any) -> bool:
        """Whether `adapter` can take the run now: any can before its first token; after it,
        one of our workers from the exact tokens, or a member that continues a final
        assistant message from the text."""
        if not self.generated:
            return True
        if self.traced and getattr(adapter, "continues_runs", False):
            return True
        return getattr(adapter, "continues_text", False) and self._text_continuable

    @property
    def _text_continuable(self) -> bool:
        format_type = (self.original.response_format or {}).get("type", "text")
        token_ids = isinstance(self.original.prompt, list)  # no text to grow them by
        return not self.called and format_type == "text" and not token_ids

    def begin_on(self, adapter: Any) -> ChatRequest:
        """What `adapter` is asked: the request, its continuation from the exact tokens, or
        from the text so far."""
        self.carried = None
        if not self.generated:
            return self.original
        if self.traced and getattr(adapter, "continues_runs", False):
            return replace(self.original, continuation=list(self.ids))
        self.carried = self.tokens
        return continued_from_text(self.original, "".join(self.text), self.tokens)

    def passed(self, batch: list[Event]) -> list[Event]:
        """Note what `batch` carries; what of it goes on to the run (a continuing member's
        `start` and `admitted` were already reported by the first)."""
        self.started = True
        if self.migrating:
            batch = [e for e in batch if type(e) is not Accepted and type(e) is not Admitted]
        for event in batch:
            kind = type(event)
            if kind is TextDelta or kind is ToolCallDelta:
                self.generated = True
            if (kind is TextDelta or kind is ToolCallDelta) and event.index == 0:
                self._note_text(event)
                ids = event.token_ids
                if ids is None or (kind is TextDelta and len(ids) != event.tokens):
                    self.traced = False  # a token without its id: nothing exact to resubmit
                else:
                    self.ids.extend(ids)
            elif kind is Finish and event.index == 0:
                self.finished = True
        if self.carried is not None:
            batch = [self._in_run_terms(e) if type(e) is Usage else e for e in batch]
        return batch

    def _note_text(self, event: TextDelta | ToolCallDelta) -> None:
        if type(event) is TextDelta:
            self.text.append(event.text)
            self.tokens += event.tokens
        else:
            self.called = True

    def _in_run_terms(self, usage: Usage) -> Usage:
        """A text-continuing member's usage as the run's: its prompt held the carried tokens,
        which the run generated."""
        carried = self.carried or 0
        return Usage(max(0, usage.prompt_tokens - carried), usage.completion_tokens + carried)

    def why_not_continued(self) -> str | None:
        """None when the run can move to another member now; else the outcome to count."""
        if self.aborting or self.finished:
            return "not_needed"
        if self.generated and (self.original.n != 1 or not (self.traced or self._text_continuable)):
            return "not_continuable"
        if self.migrations >= MAX_MIGRATIONS:
            return "failed"
        return None


def continued_from_text(request: ChatRequest, text: str, tokens: int) -> ChatRequest:
    """`request` asked again with `text` (`tokens` generated tokens) as the assistant's open
    message, for `max_tokens` less those tokens. A raw prompt (a legacy completion) is
    continued by growing the prompt itself."""
    left = None if request.max_tokens is None else max(1, request.max_tokens - tokens)
    if request.prompt is not None:
        return replace(request, prompt=request.prompt + text, max_tokens=left)
    messages = list(request.messages)
    if request.continue_final_message:  # the client's own open message, grown by the text
        last = messages[-1]
        messages[-1] = replace(last, content=(last.content or "") + text)
    else:
        messages.append(Message("assistant", text))
    return replace(request, messages=messages, continue_final_message=True, max_tokens=left)
