"""One chat request's run, from its Idempotency-Key claim to its settlement, owned in one place.

In order: the key is claimed (or the run an earlier request with it started is found), the
tenant's quota reserves the run, the run starts; when it is over, however it ends, the unused
reservation is refunded, its ending is kept with its key, and it leaves one usage record. What
is taken is given back here too: a first attempt that fails before its run starts releases its
reservation and its key, so a retry can try again.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field, replace

from aiohttp import web

from adapters.base import Adapter
from adapters.fallback import FallbackRun
from adapters.requests import ChatRequest, Message
from gateway.app_keys import (
    AUTH,
    DEFERRED,
    FLOWS,
    LEDGER,
    METRICS,
    OPENER,
    PRICES,
    PRINCIPAL,
    QUOTAS,
    RATE_HEADERS,
    ROUTE,
    RUNS,
    SETTINGS,
    STARTED,
    TENANT,
)
from gateway.eager_tasks import start_eagerly
from gateway.http.errors import APIError, overloaded
from gateway.runs import replays
from gateway.runs.accounting import usage_record
from gateway.runs.admission import (
    backend_for,
    no_wait,
    prompt_estimate,
    quota_request,
    refused,
    release,
    reserve,
)
from gateway.runs.aliases import alias_ticket
from gateway.runs.driver import RunDriver
from gateway.runs.early_upstream import EarlyUpstream
from gateway.runs.flow_control import Shed, Ticket
from gateway.runs.manager import new_run_id
from gateway.runs.spec import RunOutcome, RunSpec
from gateway.state.redis_open import KeyClaim, RedisOpener
from gateway.state.run_store import TerminalRecord
from gateway.tracing.setup import run_trace
from policies.idempotency import body_fingerprint
from policies.quotas import Admission, QuotaExceeded

# The run's id, on the answer that starts it: a stream's headers go out (at the latest one
# heartbeat interval in) before its first chunk, which may wait while the run is queued.
RUN_ID_HEADER = "x-sluice-run-id"
# Seconds a completed run's quota release may hold its ending back (RunLife._release_first).
RELEASE_FIRST_WITHIN = 0.25
# The tasks opening runs: the loop holds tasks weakly, and one whose client left has no other
# holder until its driver (RunManager.drivers) holds it.
_OPENING: set[asyncio.Task[None]] = set()


@dataclass(slots=True, frozen=True)
class Opened:
    """What a chat request answers from: the run to follow, or (`ending`) the saved ending of
    the run its Idempotency-Key started, once that run is no longer kept; and the headers the
    answer carries (rate limits, `idempotent-replayed`)."""

    run_id: str
    ending: TerminalRecord | None = None
    headers: dict[str, str] = field(default_factory=dict)


class RunLife:
    def __init__(
        self,
        request: web.Request,
        chat: ChatRequest,
        body: dict,
        *,
        run_id: str | None = None,
        meta: dict | None = None,
        key_part: int = 0,
    ) -> None:
        """Checks the request for its tenant (model, access, caps, a ready backend): an
        APIError here means nothing was claimed or reserved. `run_id` and `meta` are a
        Responses request's (its `resp_` id, its fields kept with the run record).
        `key_part`: which of the request's runs this is, when it opens several (a legacy
        completion's prompts): each after the first claims its Idempotency-Key as `KEY#part`."""
        self.app = request.app
        self.request = request
        self.tenant = request[TENANT]
        self.principal = request[PRINCIPAL]
        self.chat = chat
        self.body = body
        adapter = backend_for(request, self.tenant, chat, body)
        chat.cache_salt = self.tenant.cache_salt
        shared = self.app[AUTH].config.shared_system_prompts  # the current file's, reloads too
        chat.shared_system_prompt = opens_with_shared_prompt(chat.messages, shared)
        self.key = replays.idempotency_key(request)
        if self.key is not None and key_part:
            self.key = f"{self.key}#{key_part}"
        self.spec = RunSpec(
            run_id=run_id or new_run_id(),
            chat=chat,
            adapter=adapter,
            tenant=self.tenant.name,
            principal=self.principal.label,
            deadlines=self.app[SETTINGS].deadlines(self.tenant.deadlines),
            started=request[STARTED],
            safety=self.tenant.safety,
            meta=meta or {},
            trace=run_trace(self.app, request.headers, self.tenant, body),
        )
        self.admission: Admission | None = None
        self._driver: RunDriver | None = None  # the run this request started, until it runs

    async def open(self) -> Opened:
        """Claim, reserve, start; or find what a repeat of this request answers from.

        The run opens in a task of its own, which then drives it: a run's first step upstream
        waits for no second task to be scheduled. That task starts eagerly: its way to the
        upstream runs now, in this request's turn of the loop, not a turn later (under load a
        burst of other streams' chunks)."""
        opened: asyncio.Future[Opened] = asyncio.get_running_loop().create_future()
        task = start_eagerly(self._open_and_drive(opened), name=f"run {self.spec.run_id}")
        if not opened.done():  # held until it has opened: then its driver holds it
            _OPENING.add(task)
            task.add_done_callback(_OPENING.discard)
        try:
            # NOTE: not shielded (a shield's two callbacks cost the answer two turns of a busy
            # loop): this request's cancel cancels `opened`, which the opening task then sees
            return await opened
        except asyncio.CancelledError:
            # NOTE: a client that goes away while its run is opening must not strand a claim,
            # a concurrency slot or a reservation: the opening completes, and its run, which
            # nobody will follow, is cancelled (and settles like any other).
            opened.add_done_callback(self._abandoned)
            raise

    async def _open_and_drive(self, opened: asyncio.Future[Opened]) -> None:
        """Open the run and answer `opened`; then drive the run started, in this task."""
        try:
            result = await self._open()
        except asyncio.CancelledError:
            opened.cancel()
            raise
        except BaseException as exc:
            if not opened.done():  # the request answers with it, unless it has gone
                opened.set_exception(exc)
            if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: the loop's too
                raise
            return
        if opened.cancelled():  # the request went away meanwhile
            self._abandon(result)
        else:
            opened.set_result(result)
        _OPENING.discard(asyncio.current_task())
        # NOTE: the driver holds this request's settle, so it is not kept here as well: a
        # reference cycle would keep an ended run's log and result until the collector runs
        driver, self._driver = self._driver, None
        if driver is not None:
            # NOTE: nothing between the driver's registration (RunManager.start) and here may
            # suspend: a shutdown's cancel of its task must land inside `run`, which settles
            assert driver.task is asyncio.current_task()
            await driver.run()

    async def _open(self) -> Opened:
        ticket = self._take_ticket()
        self.spec = replace(self.spec, ticket=ticket)
        try:
            opened = await self._open_run()
        except BaseException:
            ticket.done(None, 0)  # no run: its place goes back
            raise
        if opened.run_id != self.spec.run_id:  # a repeat, answered from the earlier run
            ticket.done(None, 0)
            self.request.pop(ROUTE, None)  # a model alias's route it planned, never taken
        return opened

    def _take_ticket(self) -> Ticket:
        """The run's place in its backend's flow control; for a model alias, in its first
        target's whose queue takes it (gateway/runs/aliases.py)."""
        adapter = self.spec.adapter
        if isinstance(adapter, FallbackRun):
            return alias_ticket(adapter, self._ticket_at)
        return self._ticket_at(adapter)

    def _ticket_at(self, backend: Adapter) -> Ticket:
        """The run's place in `backend`'s flow control: dispatched at once, or queued; a
        429 when its tenant's queue is full (design §12), a 503 when it would wait and its
        request may not (`x-sluice-no-wait`, design §11)."""
        chat, app = self.chat, self.app
        prompt = prompt_estimate(chat)
        cost = prompt + (chat.max_tokens or app[SETTINGS].default_max_tokens) * chat.n
        flow = app[FLOWS].of(backend)
        if not flow.at_once() and no_wait(self.request):
            raise overloaded(
                f"Model '{chat.model}' is at capacity and this request may not wait.",
                flow.retry_after(),
            )
        sharing = self.tenant.sharing
        try:
            return flow.admit(
                self.spec.run_id, self.tenant.name, chat.share, sharing.max_queued, prompt, cost
            )
        except Shed as exc:
            raise shed(exc) from None

    async def _open_run(self) -> Opened:
        opener = self.app.get(OPENER)
        if opener is not None and (opened := await self._open_at_once(opener)) is not None:
            return opened
        if self.key is not None:
            replay = await replays.claim(
                self.request, self.tenant.name, self.key, self.body, self.spec.run_id
            )
            if replay is not None:
                return Opened(replay.run_id, replay.answer, dict(replays.REPLAYED))
        try:
            try:
                self.admission, headers = await reserve(
                    self.app, self.tenant, self.chat, self.spec.run_id
                )
            except APIError:
                self.request[RATE_HEADERS] = {}  # a refusal carries its own
                raise
            self.request[RATE_HEADERS] = headers
            self._driver = await self.app[RUNS].start(
                self.spec, self.settle, here=True, before_ending=self._release_first
            )
        except BaseException:
            await asyncio.shield(self._give_back())
            raise
        return Opened(self.spec.run_id)

    async def _open_at_once(self, opener: RedisOpener) -> Opened | None:
        """With Redis: claim, reserve and record the run in one round trip. None when another
        run holds the key (nothing was taken): the step-by-step path answers that repeat.

        Without a key, the run's upstream request leaves before that round trip is back where
        the opening can refuse nothing (a tenant without limits), or is all but sure not to
        (one far from its limits by its latest admission here, policies/headroom.py); a
        refusal then closes it."""
        app, spec = self.app, self.spec
        claim = None
        if self.key is not None:
            fingerprint = body_fingerprint(self.body)
            ttl = app[SETTINGS].idempotency_ttl
            claim = KeyClaim(self.tenant.name, self.key, fingerprint, spec.run_id, ttl)
        record = app[RUNS].record_for(spec)
        quota = quota_request(app, self.tenant, self.chat, spec.run_id)
        early = None
        if claim is None and opener.runs.health.available and opener.roomy(quota):
            early = self._early_upstream()
        try:
            opening = await opener.open(claim, quota, record)
        except BaseException as exc:
            if early is not None:  # no run (refused, Redis away): nothing upstream works for it
                app[METRICS].early_upstreams.labels("closed").inc()
                await asyncio.shield(early.aclose())
                if spec.trace is not None:
                    spec.trace.abandon(type(exc).__name__)
            if isinstance(exc, QuotaExceeded):
                self.request[RATE_HEADERS] = {}  # a refusal carries its own
                raise refused(app, exc) from None
            raise
        if opening.held is not None:  # not with an early upstream: it had no key
            return None
        if early is not None:
            app[METRICS].early_upstreams.labels("kept").inc()
        self.admission = opening.admission
        self.request[RATE_HEADERS] = opening.admission.headers if opening.admission else {}
        try:
            self._driver = await app[RUNS].start(
                spec, self.settle, record, here=True, early=early, before_ending=self._release_first
            )
        except BaseException:
            if early is not None:
                await asyncio.shield(early.aclose())
            await asyncio.shield(self._give_back())
            raise
        return Opened(spec.run_id)

    def _early_upstream(self) -> EarlyUpstream | None:
        """The run's upstream request, sent now, while its opening is on its way
        (gateway/runs/early_upstream.py); None where the run waits its turn at its backend.
        A traced run's span opens first: the upstream call carries it."""
        spec = self.spec
        if spec.ticket is None or not spec.ticket.dispatched:
            return None
        if spec.trace is not None:
            spec.trace.start(spec, None)
        return EarlyUpstream(spec.adapter, self.chat, spec.run_id)

    async def _release_first(
        self, prompt_tokens: int | None, generated_tokens: int, model: str
    ) -> None:
        """A completed run gives its reservation back before its clients hear it ended: a client
        that sends its next request the moment it reads `[DONE]` finds its concurrency slot free
        and its unused tokens refunded (on Redis the release is a round trip, which the
        settlement, after the ending, made a moment too late). Bounded, and only while Redis
        answers: else the settlement gives it back, as for a run that ended early."""
        admission = self.admission
        if admission is None or not self.app[RUNS].health.available:
            return
        try:
            async with asyncio.timeout(RELEASE_FIRST_WITHIN):
                await release(
                    self.app, self.chat, admission, prompt_tokens, generated_tokens, model
                )
        except Exception:  # a timeout, a failure: the settlement releases (idempotently)
            return
        self.admission = None

    async def _give_back(self) -> None:
        """The run did not start: its reservation and its key go back."""
        deferred = self.app[DEFERRED]
        if self.admission is not None:
            admission = self.admission
            await deferred.run("quota release", lambda: self.app[QUOTAS].release(admission, 0))
        if self.key is not None:
            key, tenant, run_id = self.key, self.tenant.name, self.spec.run_id
            await deferred.run(
                "idempotency release", lambda: replays.release(self.request, tenant, key, run_id)
            )

    def _abandoned(self, opening: asyncio.Future[Opened]) -> None:
        if not opening.cancelled() and opening.exception() is None:
            self._abandon(opening.result())

    def _abandon(self, opened: Opened) -> None:
        """Nobody will read what this request opened: a run of its own that is not a
        background one is cancelled (and settles like any other)."""
        background = self.spec.meta.get("background", False)  # read later, by its id
        if opened.run_id == self.spec.run_id and not background:  # ours: nobody will read it
            self.app[RUNS].cancel_here(opened.run_id, "disconnect")

    async def settle(self, outcome: RunOutcome) -> None:
        """The run is over: its ending with its key, the unused reservation refunded, one
        usage record. A Redis outage defers the first two (gateway/state/store_health.py); the
        record falls back to this host's file (gateway/state/ledger.py). The three are independent,
        so they go together (with Redis: one pipeline)."""
        app, deferred = self.app, self.app[DEFERRED]
        record = usage_record(outcome, app[PRICES].get(outcome.model))
        if record.cost:
            app[METRICS].tenant_cost.labels(outcome.tenant).inc(record.cost)
        writes = [app[LEDGER].append(record)]
        if self.key is not None:
            key, terminal = self.key, outcome.terminal
            writes.append(
                deferred.run(
                    "idempotency ending",
                    lambda: replays.remember(app, outcome.tenant, key, outcome.run_id, terminal),
                )
            )
        if self.admission is not None:  # not already given back as it ended
            counts = (outcome.prompt_tokens, outcome.generated_tokens, outcome.model)
            writes.append(release(app, self.chat, self.admission, *counts))
        for result in await asyncio.gather(*writes, return_exceptions=True):
            if isinstance(result, BaseException):
                raise result


def shed(exc: Shed) -> APIError:
    """The 429 for a run its tenant's full queue turned away (design §12)."""
    return APIError(
        429,
        f"Too many of your requests are waiting for capacity in the '{exc.tier}' tier; "
        "retry later, or send fewer at once.",
        type="requests",
        code="rate_limit_exceeded",
        headers={"retry-after": str(math.ceil(exc.retry_after))},
    )


def opens_with_shared_prompt(messages: list[Message], shared: frozenset[str]) -> bool:
    """Whether the first message is a system prompt the tenants file declares shared: only its
    text is then cached for all tenants (design §5); a near miss shares nothing."""
    first = messages[0] if messages else None
    return first is not None and first.role in ("system", "developer") and first.content in shared
