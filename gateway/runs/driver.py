"""Drives one run: adapter events → rendered chunks in the run's event log → one terminal state.

The driver runs as its own task, apart from any HTTP connection: clients follow the event log
(and may come and go); the driver alone talks to the upstream. The first of completion, an
upstream failure, a cancel (from any source) or a deadline becomes the run's decision; the store's
compare-and-set makes its terminal state the only one.

A cancel or a deadline ends the run for its clients at once (terminal state and error frame
written first), then asks the upstream to stop at its next step and keeps reading until the
upstream confirms: what arrives meanwhile is the tail, counted and never sent. An upstream that
cannot abort in-band, or does not confirm within `confirm_timeout`, has its stream closed, which
aborts the work there.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing

import structlog

from adapters.base import Adapter, BackendFailed, BackendRejected, BackendUnavailable
from adapters.events import Accepted, Admitted, ErrorEvent, Event, TextDelta, ToolCallDelta
from adapters.requests import ChatRequest
from adapters.to_openai import ChunkRenderer, CompletionBuilder
from gateway.errors import from_backend
from gateway.metrics import GatewayMetrics
from gateway.runs.accounting import Decision, RunAccounting
from gateway.runs.deadlines import Deadlines
from gateway.runs.endings import STORE_LOST_CAUSE, ending
from gateway.runs.status import RunStatus
from gateway.runs.store import LogClosed, RunStore, TerminalRecord

BACKEND_ERRORS = (BackendRejected, BackendUnavailable, BackendFailed)
log = structlog.get_logger("sluice.runs")


class RunDriver:
    def __init__(
        self,
        store: RunStore,
        adapter: Adapter,
        run_id: str,
        chat: ChatRequest,
        *,
        tenant: str = "",
        deadlines: Deadlines | None = None,
        metrics: GatewayMetrics | None = None,
        started: float | None = None,
        confirm_timeout: float = 5.0,
        principal: str = "",
        on_settled: Callable[[RunDriver], Awaitable[None]] | None = None,
    ) -> None:
        """`on_settled` runs once the run is over and accounted (quota refund, usage record)."""
        self.store = store
        self.adapter = adapter
        self.run_id = run_id
        self.chat = chat
        self.tenant = tenant
        self.principal = principal
        self.on_settled = on_settled
        self.deadlines = deadlines or Deadlines()
        self.confirm_timeout = confirm_timeout
        self.started = time.monotonic() if started is None else started
        self.acct = RunAccounting(metrics or GatewayMetrics(), chat.model, self.started)
        self.renderer = ChunkRenderer(run_id, chat.model)
        self.builder = CompletionBuilder(chat.n)
        self.decision: Decision | None = None
        self.terminal: TerminalRecord | None = None
        self.admitted = False
        self._opened = False  # the role chunks are in the log
        self._decoding = False  # the first token came
        self._task: asyncio.Task[TerminalRecord | None] | None = None
        self._stopper: asyncio.Task[None] | None = None
        self._started = False
        self._reading = False  # inside the upstream stream: cancelling the task closes it
        self._watchdog: asyncio.TimerHandle | None = None

    @property
    def task(self) -> asyncio.Task[TerminalRecord | None] | None:
        return self._task

    @property
    def cancel_source(self) -> str | None:
        return self.decision.source if self.decision else None

    def start(self) -> asyncio.Task[TerminalRecord | None]:
        self._task = asyncio.create_task(self.run(), name=f"run {self.run_id}")
        return self._task

    def cancel(self, source: str) -> bool:
        """Stop the run (idempotent); `source` is `client`, `disconnect`, `safety`, …
        False when its fate was already decided."""
        return self._decide(RunStatus.CANCELLED, f"cancel:{source}", source)

    def lose_store(self) -> bool:
        """The shared store stayed away past its grace: end the run (failed,
        `store_unavailable`) and stop the upstream; False when its fate was already decided."""
        return self._decide(RunStatus.FAILED, STORE_LOST_CAUSE, "store")

    async def run(self) -> TerminalRecord | None:
        self._started = True
        try:
            if self.decision is None:
                await self._drive()
            elif self.decision.source is not None:  # cancelled before the first step
                self.acct.confirmed_at = self.decision.at  # nothing was started upstream
                await self._end()
        except asyncio.CancelledError:
            if self.decision is None:  # the gateway is shutting down
                self._decide(RunStatus.FAILED, "shutdown")
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._end())
                raise
        except BACKEND_ERRORS as exc:
            if self.decision is None:
                status = (
                    RunStatus.REJECTED if isinstance(exc, BackendRejected) else RunStatus.FAILED
                )
                self._decide(status, f"upstream:{type(exc).__name__}")
                await self._end(exc)
        except Exception as exc:  # the edge of the run's task: the store itself failed
            log.error("run failed in the gateway", run_id=self.run_id, error=type(exc).__name__)
            if self.decision is None:
                self._decide(RunStatus.FAILED, "gateway_error")
            with contextlib.suppress(Exception):
                await self._end()
        finally:
            if self._watchdog is not None:
                self._watchdog.cancel()
            if self._stopper is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._stopper)
            self.acct.settle(self.run_id, self.tenant, self.decision, self.terminal, self.principal)
            if self.on_settled is not None:
                try:
                    await self.on_settled(self)
                except Exception as exc:  # the run is over either way; say what was lost
                    log.error("run settlement failed", run_id=self.run_id, error=type(exc).__name__)
        return self.terminal

    # -- deciding --------------------------------------------------------------------------------

    def _decide(self, status: RunStatus, cause: str, source: str | None = None) -> bool:
        if self.decision is not None or (self._task is not None and self._task.done()):
            return False
        self.decision = Decision(status, cause, source, time.monotonic())
        if source is not None and self._started:
            self._stopper = asyncio.create_task(self._stop(), name=f"stop {self.run_id}")
            self._arm_watchdog(self.confirm_timeout)
        elif self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        return True

    async def _stop(self) -> None:
        """A cancel or a deadline: stop the upstream and end the run for its clients, at once."""
        abort = asyncio.ensure_future(self.adapter.abort(self.run_id))
        await self._end()
        try:
            in_band = await abort
        except Exception:  # any failure here means: close the stream instead
            in_band = False
        if not in_band and self._reading and self._task is not None:
            self._task.cancel()

    # -- driving ---------------------------------------------------------------------------------

    async def _drive(self) -> None:
        await self.store.advance(self.run_id, RunStatus.QUEUED)
        self._arm_watchdog()
        async with aclosing(self.adapter.stream(self.chat, self.run_id)) as events:
            self._reading = True
            try:
                ended = await self._read(events)
            finally:
                self._reading = False
        if self.decision is None:
            await self._complete()
        elif ended and self.decision.source is not None:
            self.acct.confirmed_at = time.monotonic()  # the upstream ended the stream itself

    async def _read(self, events: AsyncIterator[list[Event]]) -> bool:
        """Record batches until the stream ends (True) or fails (False). Deadlines and an
        unconfirmed stop interrupt it from the watchdog (by cancelling this task)."""
        async for batch in events:
            if self.decision is not None:
                self.acct.held_back(batch)
            elif not await self._record(batch):
                return False
        return True

    # NOTE: one lazy timer per run instead of a timeout around every read: it is armed for the
    # nearest deadline as last computed, and when it fires it recomputes (tokens may have come
    # since) and either acts or re-arms. Per batch the driver only notes the token time.
    def _arm_watchdog(self, delay: float | None = None) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if delay is None:
            delay = self._next_deadline()[1]
        if delay is not None:
            self._watchdog = asyncio.get_running_loop().call_later(delay, self._on_watchdog)

    def _on_watchdog(self) -> None:
        self._watchdog = None
        if self._task is None or self._task.done():
            return
        if self.decision is not None:  # the upstream did not confirm the stop in time
            if self._reading:
                self._task.cancel()  # closing the stream aborts the work there
            return
        kind, left = self._next_deadline()
        if left is not None and left <= 0:
            self._decide(RunStatus.TIMED_OUT, f"deadline:{kind}", "timeout")
        else:
            self._arm_watchdog(left)

    def _next_deadline(self) -> tuple[str, float | None]:
        """The deadline that fires first from now, and the seconds left until it."""
        now = time.monotonic()
        d, started = self.deadlines, self.started
        candidates = []
        if d.total is not None:
            candidates.append(("total", started + d.total - now))
        if not self.admitted and d.queue is not None:
            candidates.append(("queue", started + d.queue - now))
        if self.acct.first_token_at is None and d.ttft is not None:
            candidates.append(("ttft", started + d.ttft - now))
        last = self.acct.last_token_at
        if last is not None and d.inter_token is not None:
            candidates.append(("inter_token", last + d.inter_token - now))
        if not candidates:
            return "none", None
        kind, left = min(candidates, key=lambda c: c[1])
        return kind, max(0.0, left)

    async def _record(self, batch: list[Event]) -> bool:
        """Render a batch into the log; False once the upstream reported a failure."""
        payloads: list[bytes] = []
        failure: ErrorEvent | None = None
        for i, event in enumerate(batch):
            kind = type(event)
            if kind is ErrorEvent:
                failure, batch = event, batch[:i]
                break
            if kind is Accepted:
                # NOTE: the role chunks go out as soon as the upstream has taken the request, so
                # a client waiting in its queue already has its headers and a first chunk.
                if not self._opened:
                    payloads += self._open()
                continue
            if kind is Admitted or (
                not self.admitted and (kind is TextDelta or kind is ToolCallDelta)
            ):
                if not self.admitted:
                    self.admitted = True
                    await self.store.advance(self.run_id, RunStatus.ADMITTED)
                if kind is Admitted:
                    continue
            if not self._decoding and (kind is TextDelta or kind is ToolCallDelta):
                self._decoding = True
                await self.store.advance(self.run_id, RunStatus.DECODING)
            self.builder.add(event)
            chunk = self.renderer.render(event)
            if chunk is not None:
                if not self._opened:
                    payloads += self._open()
                payloads.append(chunk)
        if payloads:
            try:
                await self.store.append(self.run_id, payloads)
            except LogClosed:  # the run was ended while this batch was on its way
                self.acct.held_back(batch)
                # NOTE: a local cancel decided first; otherwise another replica ended the run
                # (it saw this replica's lease lapse): stop the upstream all the same.
                self._decide(RunStatus.FAILED, "ended_elsewhere", "lost")
                return True
        had_token = self.acct.first_token_at is not None
        self.acct.sent(batch)
        if not had_token and self.acct.first_token_at is not None:
            self._arm_watchdog()  # the first token starts the inter-token deadline
        if failure is not None:
            self._decide(RunStatus.FAILED, f"upstream:{failure.code}")
            error = {"message": failure.message, "type": failure.type, "param": None}
            await self._end(error=error | {"code": failure.code})
            return False
        return True

    def _open(self) -> list[bytes]:
        """The role chunk of every choice: the first events of the run's stream."""
        self._opened = True
        return [self.renderer.role(i) for i in range(self.chat.n)]

    async def _complete(self) -> None:
        self._decide(RunStatus.COMPLETED, "completed")
        if self.chat.include_usage and self.builder.usage is not None:
            with contextlib.suppress(LogClosed):
                await self.store.append(self.run_id, [self.renderer.usage(self.builder.usage)])
        completion = self.builder.build(self.run_id, self.chat.model, int(time.time()))
        reason = self.builder.finish_reason(0)
        record = TerminalRecord(
            RunStatus.COMPLETED, "completed", reason, completion, at=time.time()
        )
        await self._finish(record, None)

    async def _end(self, exc: BaseException | None = None, error: dict | None = None) -> None:
        """Write the decided early ending: an error frame in the stream, or, when the upstream
        refused the run before any event, an HTTP error for the request that started it."""
        assert self.decision is not None
        completion = None
        if self._opened:
            completion = self.builder.build(self.run_id, self.chat.model, int(time.time()))
        record, frame = ending(self.decision.status, self.decision.cause, completion, error)
        if exc is not None and not self._opened:
            frame = None
            api = from_backend(exc)
            error = api.body()["error"]
            record = TerminalRecord(
                record.status, record.cause, None, None, error, record.at, api.status, api.headers
            )
        await self._finish(record, frame)

    async def _finish(self, record: TerminalRecord, frame: bytes | None) -> None:
        if self.terminal is not None:
            return
        won = await self.store.finish(self.run_id, record, frame)
        self.acct.terminal_at = time.monotonic()
        self.terminal = record if won else (await self.store.get(self.run_id)).terminal
