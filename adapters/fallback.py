"""A model alias as an adapter (design §6): one public model name over its target models, tried
in order until one serves, so the run's driver and pipeline know nothing of fallbacks.

The catalog routes the alias to a `FallbackAdapter`; the gateway plans each request's `Route`
(adapters/fallback_route.py: the order, and the targets passed over before anything is asked:
not allowed, unsupported, unavailable, shed) and runs it as a `FallbackRun`, the run's adapter.
The run tries the candidates in order and moves to the next when the current one:

- fails before its first token: raises BackendUnavailable (`unavailable`) or BackendFailed, its
  member was lost, or it sends an error event (`failed`), all after its own pool's retries;
- sends no first token within the alias's `first_token_timeout` (`timeout`; its stream is
  closed, which aborts it). The last candidate has no such deadline: there is nothing to go to,
  so the run's own deadlines bound it.

A refusal (BackendRejected, a 400) is the request's own fault and ends the run as it is. Once a
target sends its first token it serves: nothing is tried after that (a member that fails later is
its pool's business). Each move to another target asks the retry budget first
(adapters/retry_budget.py, reason `fallback`); a refused move ends the run with the last error.

NOTE: until its first token a target's events are held, so the response's chunks all name the
target that served: at that token the run gets `Accepted(model=target)` (its role chunks name
it) and what the target sent. `Admitted` passes at once (it renders nothing, and the run's
queue deadline ends with it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing
from dataclasses import replace

import structlog

from adapters.base import Adapter, BackendFailed, BackendUnavailable, ModelInfo, TokenCount
from adapters.events import Accepted, Admitted, ErrorEvent, Event
from adapters.fallback_route import Alias, Route
from adapters.pool_members import MemberLost
from adapters.requests import ChatRequest
from adapters.retry_budget import RetryBudget

log = structlog.get_logger("sluice.fallback")
FAILED = (BackendFailed, MemberLost)
Outcome = Callable[[str, str], None]  # (alias, outcome) → counted


class _Skip(Exception):
    """The target cannot serve this run: pass it over for `reason`; `cause` is what the client
    gets if no target is left."""

    def __init__(self, reason: str, cause: Exception) -> None:
        super().__init__(reason)
        self.reason = reason
        self.cause = cause


class FallbackAdapter:
    def __init__(
        self,
        alias: Alias,
        targets: Mapping[str, Adapter],
        *,
        budget: RetryBudget | None = None,
        on_outcome: Outcome | None = None,
    ) -> None:
        """`targets`: each target model's adapter (the catalog's: started and probed by their
        owner, not by the alias). `budget`: the gateway's retry budget (None: fallbacks are not
        bounded). `on_outcome(alias, outcome)`: a request's route ended (`served_first`,
        `fell_back`, `exhausted`)."""
        missing = [m for m in alias.models if m not in targets]
        if missing:
            raise ValueError(f"alias {alias.name!r} has no adapter for {', '.join(missing)}")
        self.alias = alias
        self.name = f"alias:{alias.name}"
        self.targets = dict(targets)
        self.budget = budget
        self.on_outcome = on_outcome
        self._live: dict[str, FallbackRun] = {}  # request id → its run, while it streams

    @property
    def target_adapters(self) -> list[Adapter]:
        return [self.targets[m] for m in self.alias.models]

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def models(self) -> list[ModelInfo]:
        """The alias as a model; its context is the shortest its targets say they have."""
        lengths = []
        for model, adapter in self.targets.items():
            for info in await adapter.models():
                if info.id == model and info.max_model_len:
                    lengths.append(info.max_model_len)
        return [ModelInfo(self.alias.name, max_model_len=min(lengths, default=None))]

    async def ready(self) -> bool:
        return any(await asyncio.gather(*(a.ready() for a in self.target_adapters)))

    def unsupported_param(self, request: ChatRequest) -> str | None:
        """A parameter no target can honour (the others are passed over)."""
        refused = [a.unsupported_param(request) for a in self.target_adapters]
        return None if None in refused else refused[0]

    def plan(self, request: ChatRequest) -> Route:
        return Route(self.alias.name, self.alias.order(request))

    def run(self, route: Route) -> FallbackRun:
        return FallbackRun(self, route)

    def stream(self, request: ChatRequest, request_id: str) -> AsyncIterator[list[Event]]:
        """A run over every target, in the request's order (no tenant, no health: the gateway
        plans its runs itself and streams them as `FallbackRun`s)."""
        return self.run(self.plan(request)).stream(request, request_id)

    async def count_tokens(self, request: ChatRequest, request_id: str) -> TokenCount | None:
        """The count of the target this request would try first; None where it cannot count."""
        target = self.alias.order(request)[0]
        count = getattr(self.targets[target], "count_tokens", None)
        return None if count is None else await count(replace(request, model=target), request_id)

    async def abort(self, request_id: str) -> bool:
        run = self._live.get(request_id)
        return False if run is None else await run.abort(request_id)

    def count(self, outcome: str) -> None:
        if self.on_outcome is not None:
            self.on_outcome(self.alias.name, outcome)


class FallbackRun:
    """One request's run through its route: the adapter its driver streams from."""

    def __init__(self, fallback: FallbackAdapter, route: Route) -> None:
        self.fallback = fallback
        self.route = route
        self.name = fallback.name
        self.aborting = False
        self._current: Adapter | None = None  # the target streaming now

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def models(self) -> list[ModelInfo]:
        return await self.fallback.models()

    async def ready(self) -> bool:
        return await self.fallback.ready()

    def unsupported_param(self, request: ChatRequest) -> str | None:
        return self.fallback.unsupported_param(request)

    def adapter_of(self, target: str) -> Adapter:
        return self.fallback.targets[target]

    async def abort(self, request_id: str) -> bool:
        """To the target streaming now; no target is tried after it."""
        self.aborting = True
        current = self._current
        return False if current is None else await current.abort(request_id)

    async def stream(self, request: ChatRequest, request_id: str) -> AsyncIterator[list[Event]]:
        live = self.fallback._live
        live[request_id] = self
        try:
            async for batch in self._through_targets(request, request_id):
                yield batch
        finally:
            self._current = None
            if live.get(request_id) is self:
                del live[request_id]

    async def _through_targets(
        self, request: ChatRequest, request_id: str
    ) -> AsyncIterator[list[Event]]:
        route, budget = self.route, self.fallback.budget
        if budget is not None:
            budget.requested(request_id)  # a pool counts it too: once per id
        cause: Exception | None = None
        candidates = route.candidates()
        for n, target in enumerate(candidates):
            if cause is not None and budget is not None and not budget.allow("fallback"):
                route.skip(target, "budget")
                break
            route.trying = target
            try:
                async for batch in self._from(
                    target, request, request_id, n + 1 == len(candidates)
                ):
                    yield batch
                return
            except _Skip as skip:
                if self.aborting:
                    raise skip.cause from None  # the run is ending anyway: nothing more to try
                route.skip(target, skip.reason)
                if request.trace is not None:
                    request.trace.event("sluice.fallback", target=target, reason=skip.reason)
                cause = skip.cause
                log.warning(
                    "alias target passed over", alias=route.alias, target=target, why=skip.reason
                )
        if not self.aborting:
            self.fallback.count("exhausted")
        raise cause or BackendUnavailable(
            f"No target of model '{route.alias}' can serve this request now; retry shortly."
        )

    async def _from(
        self, target: str, request: ChatRequest, request_id: str, last: bool
    ) -> AsyncIterator[list[Event]]:
        """One target's stream: `_Skip` until its first token, then everything it sends."""
        adapter = self.fallback.targets[target]
        self._current = adapter
        timeout = None if last else self.fallback.alias.first_token_timeout
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        async with aclosing(adapter.stream(replace(request, model=target), request_id)) as events:
            prompt: int | None = None  # the prompt's tokens, where the target's Accepted says
            while True:  # until its first token
                batch = await self._next(events, deadline, target)
                if batch is None:  # it ended without a token: what it sent is its answer
                    self._serve(target)
                    yield [Accepted(target, prompt)]
                    return
                prompt = next((e.prompt_tokens for e in batch if type(e) is Accepted), prompt)
                opening, batch = self._opening(batch, last)
                if opening:
                    self._serve(target)
                    yield [Accepted(target, prompt), *batch]
                    break
                if batch:
                    yield batch  # Admitted only
            async for batch in events:
                yield batch

    async def _next(
        self, events: AsyncIterator[list[Event]], deadline: float | None, target: str
    ) -> list[Event] | None:
        """The target's next batch before its first token (None at its end); `_Skip` when it
        failed or its first token is late."""
        try:
            async with asyncio.timeout_at(deadline) as clock:
                return await anext(events)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            if not clock.expired():
                raise
            late = BackendUnavailable(f"Model '{target}' did not start answering in time.")
            raise _Skip("timeout", late) from None
        except BackendUnavailable as exc:
            raise _Skip("unavailable", exc) from None
        except FAILED as exc:
            cause = exc if isinstance(exc, BackendFailed) else BackendFailed(str(exc))
            raise _Skip("failed", cause) from None

    def _opening(self, batch: list[Event], last: bool) -> tuple[bool, list[Event]]:
        """(whether this batch carries the target's first output, the events to pass on). An
        error before any output passes the target over, unless it is the last (or the run is
        stopping): then it is the run's to end with."""
        passed = [e for e in batch if type(e) is not Accepted]
        for event in passed:
            kind = type(event)
            if kind is ErrorEvent and not (last or self.aborting):
                raise _Skip("failed", BackendFailed(event.message))
            if kind is not Admitted:
                return True, passed
        return self.aborting, passed

    def _serve(self, target: str) -> None:
        self.fallback.count(self.route.serve(target))
