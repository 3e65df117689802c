"""Drives one run: adapter events → the run's pipeline → its event log → one terminal state, then
one outcome for whoever settles the run.

The driver runs as its own task, apart from any HTTP connection: clients follow the event log
(and may come and go); the driver alone talks to the upstream. Its `phase` says where it is; the
run's status (RunStatus) is what the store records. The first of completion, an upstream
failure, a cancel (from any source), a deadline or a lost store becomes the run's `ending`; the
store's compare-and-set makes its terminal state the only one. There is one way to end early,
`stop` (gateway/runs/stopping.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any

import structlog

from adapters.base import BackendFailed, BackendRejected, BackendUnavailable
from adapters.events import Event
from gateway.metrics import GatewayMetrics
from gateway.overhead import RunOverhead
from gateway.runs.accounting import Ending, RunAccounting, record_outcome
from gateway.runs.deadline_watch import DeadlineWatch
from gateway.runs.deadlines import Alarm
from gateway.runs.early_upstream import EarlyUpstream
from gateway.runs.endings import (
    ending,
    error_body,
    refusal,
    scan_batch,
    stage_failure,
)
from gateway.runs.flow_control import Shed, Withdrawn
from gateway.runs.pipeline import RunPipeline, Stage
from gateway.runs.spec import RunOutcome, RunSpec
from gateway.runs.status import Phase, RunStatus
from gateway.runs.stopping import CLOSE, Stopping
from gateway.state.run_store import Chunk, LogClosed, RunStore, TerminalRecord
from gateway.tasks import finish_then_reraise

BACKEND_ERRORS = (BackendRejected, BackendUnavailable, BackendFailed, Shed)
log = structlog.get_logger("sluice.runs")

Settle = Callable[[RunOutcome], Awaitable[None]]
# a completed run's prompt and generated tokens and serving model, before its ending is written
BeforeEnding = Callable[[int | None, int, str], Awaitable[None]]


class RunDriver(Stopping, DeadlineWatch):
    def __init__(
        self,
        spec: RunSpec,
        store: RunStore,
        *,
        metrics: GatewayMetrics | None = None,
        confirm_timeout: float = 5.0,
        settle: Settle | None = None,
        stages: Sequence[Stage] = (),
        created: int | None = None,
        early: EarlyUpstream | None = None,
        before_ending: BeforeEnding | None = None,
    ) -> None:
        """`settle` runs once the run is over and accounted (the tenant's refund, its usage
        record); `created` is the run record's creation time (the chunks carry it); `early`,
        the run's upstream stream, begun while the run opened (gateway/runs/early_upstream.py);
        `before_ending`, what a completed run settles before its clients hear it ended."""
        self.spec = spec
        self.run_id = spec.run_id
        self.store = store
        self.metrics = metrics or GatewayMetrics()
        self.confirm_timeout = confirm_timeout
        self.settle = settle
        self.before_ending = before_ending
        chat = spec.chat
        created = int(time.time()) if created is None else created
        tier = chat.share.tier if chat.share is not None else None
        self.pipeline = RunPipeline(
            spec.run_id, chat.model, created, chat.n, stages, tier, chat.usage_on_open
        )
        self.acct = RunAccounting(self.metrics, spec.started or time.monotonic(), spec.trace)
        self.overhead = RunOverhead(self.metrics.overhead, self.acct.started)
        self.phase = Phase.NEW
        self.status = RunStatus.RECEIVED  # as recorded in the store
        self.ending: Ending | None = None
        self.terminal: TerminalRecord | None = None
        self.outcome: RunOutcome | None = None
        self._task: asyncio.Task[Any] | None = None  # the task that runs `run`
        self._timer = Alarm()  # deadlines, then the stop's confirmation
        self._stopping: asyncio.Task[None] | None = None
        self._early = early  # until `_drive` reads it (or `run` closes it unread)

    @property
    def task(self) -> asyncio.Task[Any] | None:
        return self._task

    def start(self) -> asyncio.Task[RunOutcome]:
        self._task = asyncio.create_task(self.run(), name=f"run {self.run_id}")
        return self._task

    def adopt(self) -> asyncio.Task[Any]:
        """The current task runs the run: its caller awaits `run()` next, with no suspension
        in between (a run opened in its own task goes on to drive it there, a turn of the
        event loop sooner than a task started for it)."""
        self._task = asyncio.current_task()
        return self._task

    # -- the run's life ------------------------------------------------------------------------

    async def run(self) -> RunOutcome:
        shutdown: asyncio.CancelledError | None = None  # the gateway's own cancel of the task
        try:
            try:
                if self.ending is None:
                    await self._drive()
                else:  # stopped before the first step: nothing to confirm (an early stream
                    # begun for it is closed below)
                    self.acct.confirmed_at = self.ending.at
            except asyncio.CancelledError as exc:
                if exc.args != (CLOSE,):  # the gateway is shutting down
                    raise
                self.phase = Phase.ENDED
                asyncio.current_task().uncancel()  # our own: the stream is closed; settle
            if self._stopping is not None:
                await asyncio.shield(self._stopping)  # it wrote an early ending
            await self._end()
        except asyncio.CancelledError as exc:
            shutdown = exc
            self.phase = Phase.ENDED
            self.stop(RunStatus.FAILED, "shutdown")
            with contextlib.suppress(Exception):
                await asyncio.shield(self._end())
        except BACKEND_ERRORS as exc:
            self.phase = Phase.ENDED
            if self.ending is None:
                refused = refusal(exc)
                if not self.pipeline.opened:  # before its first event: a plain HTTP answer
                    self.ending = Ending(refused.status, refused.cause, None, time.monotonic())
                    await self._finish(refused, None)
                else:  # after it: an error frame
                    self.stop(refused.status, refused.cause, error=refused.error)
            await self._end()
        except Exception as exc:  # the edge of the run's task: the store itself failed
            log.error("run failed in the gateway", run_id=self.run_id, error=type(exc).__name__)
            self.phase = Phase.ENDED
            self.stop(RunStatus.FAILED, "gateway_error")
            with contextlib.suppress(Exception):
                await self._end()
        finally:
            self.phase = Phase.ENDED
            self._timer.cancel()
            self._give_back_capacity()
            if self._early is not None:  # ended before its first step: close what was begun
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._early.aclose())
            if self._stopping is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._stopping)
        # NOTE: a run cut at shutdown is settled all the same (its refund, its ending kept with
        # its key, its usage record, its run end line), and no cancel leaves a settlement half
        # done; only a second cancel stops the wait, which RunManager.close bounds
        return await finish_then_reraise(self._settle(), shutdown)

    async def _end(self) -> None:
        """Write the run's ending: the completion (also after a stage ended every choice
        early, a safety block), or the early ending decided."""
        if self.ending is None or self.ending.status is RunStatus.COMPLETED:
            await self._complete()
        else:
            await self._write_ending()

    async def _drive(self) -> None:
        await self._advance(RunStatus.QUEUED)
        if not await self._wait_for_capacity():
            return
        self.phase = Phase.STREAMING
        self._arm()
        events, self._early = self._early, None
        if events is None:
            self.overhead.sent()
            events = self.spec.adapter.stream(self.spec.chat, self.run_id)
        else:
            self.overhead.sent(events.sent_at)
        try:
            async with aclosing(events):
                ended = await self._read(events)
        finally:
            self._give_back_capacity()  # the backend is done with it: the next may go
        self.overhead.upstream_done()
        self.phase = Phase.ENDED
        if ended and self.ending is not None and self.ending.source is not None:
            self.acct.confirmed_at = time.monotonic()  # the upstream ended the stream itself

    async def _wait_for_capacity(self) -> bool:
        """Wait for the run's turn at a saturated backend (design §12), bound by its deadlines;
        False when it was stopped meanwhile (nothing was asked upstream). A run its tenant's
        full queue sheds raises Shed: refused like a busy backend, before any event."""
        ticket = self.spec.ticket
        if self.ending is None and ticket is not None and not ticket.dispatched:
            self.phase = Phase.WAITING
            self._arm()
            waiting_since = time.monotonic()
            with contextlib.suppress(Withdrawn):  # stop() took it out of the queue
                await ticket.wait()
            self.overhead.waited = time.monotonic() - waiting_since
        if self.ending is None:
            return True
        # NOTE: stopped while waiting, or while its `queued` status was being written: nothing
        # was asked upstream, so there is nothing to confirm (its ticket goes back in run())
        self.phase = Phase.ENDED
        self.acct.confirmed_at = self.ending.at
        return False

    def _give_back_capacity(self) -> None:
        """The run no longer uses (or never will use) the backend: its place in the flow
        control goes back, its tenant charged what it used (idempotent)."""
        if self.spec.ticket is not None:
            self.spec.ticket.done(self.acct.prompt_tokens, self.acct.generated_tokens)

    async def _read(self, events: AsyncIterator[list[Event]]) -> bool:
        """Record batches until the stream ends (True) or reports a failure (False); once the
        ending is decided, what comes is tail. Deadlines and an unconfirmed stop interrupt it
        (they close the stream)."""
        overhead, acct, plain_text = self.overhead, self.acct, self.pipeline.plain_text
        async for batch in events:
            if self.phase is not Phase.STREAMING:
                acct.held_back(batch)
                continue
            arrived = time.perf_counter()
            if acct.first_token_at is not None and (chunks := plain_text(batch)) is not None:
                recorded = await self._record_text(batch, chunks)
            else:
                recorded = await self._record(batch)
            overhead.batch_done(arrived)
            if not recorded:
                return False
        return True

    async def _record(self, batch: list[Event]) -> bool:
        """One batch into the log (through the pipeline), and the run's status forward."""
        scan = scan_batch(batch)
        failure, batch = scan.failure, scan.events
        if (scan.admitted or scan.tokens) and self.status < RunStatus.ADMITTED:
            await self._advance(RunStatus.ADMITTED)
        if scan.tokens and self.status < RunStatus.DECODING:
            await self._advance(RunStatus.DECODING)
        had_token = self.acct.first_arrival_at is not None
        self.acct.arrived(batch)
        if not had_token and self.acct.first_arrival_at is not None:
            self._arm()  # the first token starts the inter-token deadline
        chunks, passed = await self.pipeline.feed(batch)
        if self.phase is not Phase.STREAMING:  # stopped while a stage was judging the batch
            self.acct.kept_out(batch)
            return True
        if chunks:
            try:
                await self.store.append(self.run_id, chunks)
            except LogClosed:  # the run was ended while this batch was on its way
                self._kept_out(batch)
                return True
        self.acct.sent(passed)
        origin = "upstream"
        if failure is None and (failure := stage_failure(passed)) is not None:
            origin = "stage"  # a stage refused what it saw (an invalid tool call)
        if failure is None:
            if (source := self.pipeline.stop_source) is not None:
                self.stop(RunStatus.COMPLETED, f"stage:{source}", source)
            return True
        self.stop(RunStatus.FAILED, f"{origin}:{failure.code}", error=error_body(failure))
        return False

    async def _record_text(self, batch: list[Event], chunks: list[Chunk]) -> bool:
        """`_record` for a batch of plain text after the first token with no stage between
        (RunPipeline.plain_text): the status, deadlines and pipeline need no step, and the
        accounting takes one."""
        try:
            await self.store.append(self.run_id, chunks)
        except LogClosed:
            self.acct.arrived(batch)
            self._kept_out(batch)
            return True
        self.acct.text_passed(batch)
        return True

    def _kept_out(self, batch: list[Event]) -> None:
        """The run was ended while this batch was on its way to the log."""
        self.acct.kept_out(batch)
        # NOTE: a local stop decided first; otherwise another replica ended the run (it saw
        # this replica's lease lapse): stop the upstream all the same.
        self.stop(RunStatus.FAILED, "ended_elsewhere", "lost")

    async def _complete(self) -> None:
        """The upstream finished (or a stage ended every choice): the rest of the stages, the
        usage chunk, the object."""
        if self.ending is None:
            self.ending = Ending(RunStatus.COMPLETED, "completed", None, time.monotonic())
        await self._advance(RunStatus.FINALIZING)
        chunks, failure = await self.pipeline.close(self.acct.usage, self.spec.chat.include_usage)
        if chunks:
            with contextlib.suppress(LogClosed):
                await self.store.append(self.run_id, chunks)
        if failure is not None:  # what a stage held was refused
            at = time.monotonic()
            self.ending = Ending(
                RunStatus.FAILED, f"stage:{failure.code}", None, at, error_body(failure)
            )
            await self._write_ending()
            return
        completion = self.pipeline.completion(int(time.time()))
        reason = self.pipeline.builder.finish_reason(0)
        record = TerminalRecord(
            RunStatus.COMPLETED, self.ending.cause, reason, completion, at=time.time()
        )
        if self.before_ending is not None:  # its counts are final: the upstream is done
            model = self.pipeline.model or self.spec.chat.model
            await self.before_ending(self.acct.prompt_tokens, self.acct.generated_tokens, model)
        await self._finish(record, None)

    async def _write_ending(self) -> None:
        """The decided early ending, written once: the terminal state and the error frame."""
        if self.terminal is not None or self.ending is None:
            return
        e = self.ending
        if e.status is RunStatus.COMPLETED:  # a stage's early end: the run completes (_end)
            return
        completion = None
        if self.pipeline.opened:
            completion = self.pipeline.completion(int(time.time()), early=True)
        record, frame = ending(e.status, e.cause, completion, e.error)
        await self._finish(record, frame)

    async def _finish(self, record: TerminalRecord, frame: Chunk | None) -> None:
        if self.terminal is not None:
            return
        won = await self.store.finish(self.run_id, record, frame)
        self.acct.terminal_at = time.monotonic()
        self.terminal = record if won else (await self.store.get(self.run_id)).terminal

    async def _settle(self) -> RunOutcome:
        terminal = self.terminal or TerminalRecord(RunStatus.FAILED, "gateway_error")
        self.outcome = outcome = self.acct.outcome(
            self.spec, self.ending, terminal, self.pipeline.model
        )
        record_outcome(self.metrics, outcome)
        self.overhead.ended(self.acct.terminal_at)
        if self.settle is not None:
            try:
                await self.settle(outcome)
            except Exception as exc:  # the run is over either way; say what was lost
                log.error("run settlement failed", run_id=self.run_id, error=type(exc).__name__)
        return outcome

    async def _advance(self, status: RunStatus) -> None:
        self.status = status
        await self.store.advance(self.run_id, status)
