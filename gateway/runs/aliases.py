"""A request for a model alias (design §6): which of its targets this request may use, in which
order, and its place in a target's flow control.

The alias itself passed the tenant's allow-list already (gateway/runs/admission.py); here each
target is checked as a model of its own, in the request's order (adapters/fallback_route.py),
and passed over when the tenant may not use it (`not_allowed`), it cannot honour a parameter of
the request (`unsupported`), or no member of it is ready (`unavailable`; one whose only members
are restarting is waited for, as a plain model's would be, only when no other target is ready
and the request may wait). Then the first target whose flow control takes the run gives it its
ticket; one whose queue turns it away (`shed`) is passed over. What is left is tried by the
run's `FallbackRun` (adapters/fallback.py). With no target left the answer is the refusal a
model of its own would get: 403 when the tenant may use none, 400 when none takes a parameter,
else 503 (or the last target's 429), counted as `exhausted`.

NOTE: the run keeps its place in the flow control of the target that admitted it, also when it
falls back to another target while streaming: flow control counts it against the first one
until it ends (docs/routing.md, Limits).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from aiohttp import web

from adapters.base import Adapter
from adapters.fallback import FallbackAdapter, FallbackRun
from adapters.requests import ChatRequest
from gateway.app_keys import HEALTH, METRICS, ROUTE
from gateway.http.errors import APIError, invalid_request, overloaded
from gateway.runs.flow_control import Ticket
from policies.tenants import Tenant


def alias_run(
    request: web.Request, tenant: Tenant, chat: ChatRequest, alias: FallbackAdapter, waits: bool
) -> FallbackRun:
    """The run's adapter: the alias's targets this request may try, in order. `waits`: the
    request may wait for a restarting target (it did not ask for `x-sluice-no-wait`)."""
    route = alias.plan(chat)
    request[ROUTE] = route  # the x-sluice-route header reads it when the answer goes out
    health = request.app[HEALTH]
    restarting, param = [], None
    for target in route.order:
        adapter = alias.targets[target]
        if not tenant.allows_model(target):
            route.skip(target, "not_allowed")
        elif (unsupported := adapter.unsupported_param(chat)) is not None:
            route.skip(target, "unsupported")
            param = param or unsupported
        elif not health.ready(adapter):
            if waits and health.restarting(adapter):
                restarting.append(target)
            else:
                route.skip(target, "unavailable")
    if len(restarting) < len(route.candidates()):  # another target serves now: no waiting
        for target in restarting:
            route.skip(target, "unavailable")
    if not route.candidates():
        raise _refusal(request, alias, route.skipped.values(), param)
    return alias.run(route)


def _refusal(
    request: web.Request, alias: FallbackAdapter, why: Iterable[str], param: str | None
) -> APIError:
    """The answer when every target was passed over for one of `why`: what a model of its own
    would answer (`param`: the first parameter a target could not honour)."""
    name, reasons = alias.alias.name, set(why)
    if reasons == {"not_allowed"}:
        request.app[METRICS].quota_rejections.labels("model").inc()
        return APIError(
            403,
            f"Your key has no access to any model behind '{name}'.",
            param="model",
            code="model_not_allowed",
        )
    if param is not None and reasons <= {"not_allowed", "unsupported"}:
        return invalid_request(
            param, f"'{param}' is not supported by model '{name}'.", code="unsupported_parameter"
        )
    alias.count("exhausted")
    return overloaded(f"No backend for model '{name}' is ready; retry shortly.")


def alias_ticket(run: FallbackRun, ticket_at: Callable[[Adapter], Ticket]) -> Ticket:
    """The run's place in the flow control of the first target whose queue takes it;
    `ticket_at(backend)` raises the APIError a target's queue answers with (a 429 when its
    tenant's queue is full, a 503 when it would wait and the request may not). That target is
    passed over (`shed`); with none left, the last refusal is the answer."""
    route, refusal = run.route, None
    for target in route.candidates():
        try:
            return ticket_at(run.adapter_of(target))
        except APIError as exc:
            route.skip(target, "shed")
            refusal = exc
    run.fallback.count("exhausted")
    assert refusal is not None  # a run has a target to try (alias_run saw to it)
    raise refusal
