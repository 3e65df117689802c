"""Drives one run: adapter events → rendered chunks in the run's event log → one terminal state.

The driver runs as its own task, apart from any HTTP connection: clients follow the event log
(and may come and go); the driver alone talks to the upstream. Every way a run can end — done,
upstream error, cancel (from any source), a deadline — goes through `_end`, and the store's
compare-and-set makes the first of them the only one. Leaving the adapter's `aclosing` block
closes the upstream stream, which aborts the work there.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from dataclasses import dataclass

import orjson

from adapters.base import Adapter, BackendFailed, BackendRejected, BackendUnavailable
from adapters.events import ErrorEvent, Event, TextDelta, ToolCallDelta
from adapters.requests import ChatRequest
from adapters.to_openai import ChunkRenderer, CompletionBuilder
from gateway.runs.state import TERMINAL_ERROR_CODE, RunStatus
from gateway.runs.store import RunStore, TerminalRecord

BACKEND_ERRORS = (BackendRejected, BackendUnavailable, BackendFailed)


@dataclass(slots=True, frozen=True)
class Deadlines:
    """Seconds; None means no limit. Each one that fires is its own terminal cause."""

    ttft: float | None = None  # run start → first token
    inter_token: float | None = None  # between tokens
    total: float | None = None  # run start → end


_MESSAGES = {
    "cancelled": "The run was cancelled.",
    "timeout": "The run exceeded its deadline.",
    "upstream_error": "The model backend failed to process the request.",
}


class RunDriver:
    def __init__(
        self,
        store: RunStore,
        adapter: Adapter,
        run_id: str,
        chat: ChatRequest,
        deadlines: Deadlines = Deadlines(),
    ) -> None:
        self.store = store
        self.adapter = adapter
        self.run_id = run_id
        self.chat = chat
        self.deadlines = deadlines
        self.renderer = ChunkRenderer(run_id, chat.model)
        self.builder = CompletionBuilder(chat.n)
        self.cancel_source: str | None = None
        self.first_token_at: float | None = None
        self.terminal: TerminalRecord | None = None
        self._task: asyncio.Task[TerminalRecord] | None = None
        self._started = False

    @property
    def task(self) -> asyncio.Task[TerminalRecord] | None:
        return self._task

    def start(self) -> asyncio.Task[TerminalRecord]:
        self._task = asyncio.create_task(self.run(), name=f"run {self.run_id}")
        return self._task

    def cancel(self, source: str) -> None:
        """Stop the run (idempotent); `source` is `client`, `disconnect`, `safety`, …"""
        if self._task is None or self._task.done() or self.cancel_source is not None:
            return
        self.cancel_source = source
        # NOTE: a task cancelled before its first step never runs a line of `run`, so no terminal
        # state would be written; an unstarted run sees `cancel_source` as it begins instead.
        if self._started:
            self._task.cancel()

    async def run(self) -> TerminalRecord:
        self._started = True
        if self.cancel_source is not None:
            return await self._end(RunStatus.CANCELLED, f"cancel:{self.cancel_source}")
        started = time.monotonic()
        last_token_at = started
        await self.store.advance(self.run_id, RunStatus.QUEUED)
        try:
            async with aclosing(self.adapter.stream(self.chat, self.run_id)) as events:
                await self.store.append(
                    self.run_id, [self.renderer.role(i) for i in range(self.chat.n)]
                )
                while True:
                    kind, wait = self._next_deadline(started, last_token_at)
                    try:
                        async with asyncio.timeout(wait):
                            batch = await anext(events)
                    except StopAsyncIteration:
                        break
                    except TimeoutError:
                        return await self._end(RunStatus.TIMED_OUT, f"deadline:{kind}")
                    if any(type(e) is TextDelta or type(e) is ToolCallDelta for e in batch):
                        last_token_at = time.monotonic()
                        if self.first_token_at is None:
                            self.first_token_at = last_token_at
                            await self.store.advance(self.run_id, RunStatus.DECODING)
                    failure = await self._record(batch)
                    if failure is not None:
                        return await self._end(RunStatus.FAILED, failure.code)
            return await self._complete()
        except asyncio.CancelledError:
            if self.cancel_source is None:
                raise  # the gateway is shutting down, not a cancel
            return await self._end(RunStatus.CANCELLED, f"cancel:{self.cancel_source}")
        except BACKEND_ERRORS as exc:
            status = RunStatus.REJECTED if isinstance(exc, BackendRejected) else RunStatus.FAILED
            return await self._end(status, type(exc).__name__)

    def _next_deadline(self, started: float, last_token_at: float) -> tuple[str, float | None]:
        """The deadline that fires first from now, and the seconds left until it."""
        now = time.monotonic()
        candidates = []
        d = self.deadlines
        if d.total is not None:
            candidates.append(("total", started + d.total - now))
        if self.first_token_at is None and d.ttft is not None:
            candidates.append(("ttft", started + d.ttft - now))
        if self.first_token_at is not None and d.inter_token is not None:
            candidates.append(("inter_token", last_token_at + d.inter_token - now))
        if not candidates:
            return "none", None
        kind, left = min(candidates, key=lambda c: c[1])
        return kind, max(0.0, left)

    async def _record(self, batch: list[Event]) -> ErrorEvent | None:
        payloads = []
        for event in batch:
            if type(event) is ErrorEvent:
                if payloads:
                    await self.store.append(self.run_id, payloads)
                return event
            self.builder.add(event)
            chunk = self.renderer.render(event)
            if chunk is not None:
                payloads.append(chunk)
        if payloads:
            await self.store.append(self.run_id, payloads)
        return None

    async def _complete(self) -> TerminalRecord:
        await self.store.advance(self.run_id, RunStatus.FINALIZING)
        if self.chat.include_usage and self.builder.usage is not None:
            await self.store.append(self.run_id, [self.renderer.usage(self.builder.usage)])
        completion = self.builder.build(self.run_id, self.chat.model, int(time.time()))
        reason = completion["choices"][0]["finish_reason"] if completion["choices"] else None
        return await self._finish(
            TerminalRecord(RunStatus.COMPLETED, "completed", reason, completion, at=time.time())
        )

    async def _end(self, status: RunStatus, cause: str) -> TerminalRecord:
        code = TERMINAL_ERROR_CODE[status]
        message = _MESSAGES.get(code, "The request was rejected.")
        error = {"message": message, "type": "server_error", "param": None, "code": code}
        record = TerminalRecord(status, cause, None, None, error, at=time.time())
        run = await self.store.get(self.run_id)
        if not run.status.is_terminal:
            await self.store.append(self.run_id, [orjson.dumps({"error": error})])
        return await self._finish(record)

    async def _finish(self, record: TerminalRecord) -> TerminalRecord:
        if not await self.store.finish(self.run_id, record):
            record = (await self.store.get(self.run_id)).terminal  # someone else ended it
        self.terminal = record
        return record
