"""Which backend computes an embeddings call: a model's own, or for a model alias (design §6)
its targets in the request's order, as a chat run goes through them.

An alias's targets are checked in the order the alias gives this call (weighted aliases stick
by the first input's text): one the tenant may not use (`not_allowed`), one whose backend serves
no embeddings (`unsupported`) or that has no ready member (`unavailable`) is passed over before
anything is asked. The others are asked in turn; one that fails (`failed`) or is busy
(`unavailable`) hands the call to the next, the retry budget allowing (reason `fallback`), and a
refusal (a 400) is the call's own answer. The route is the `x-sluice-route` header's, and the
answer's `model` is the target that served.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from adapters.base import BackendFailed, BackendUnavailable
from adapters.fallback import FallbackAdapter
from adapters.fallback_route import Route
from adapters.requests import ChatRequest
from gateway.app_keys import CATALOG, HEALTH, MODEL_LABEL, ROUTE
from gateway.http.errors import APIError, invalid_request, model_not_found, overloaded
from gateway.runs.admission import share_for
from policies.tenants import Tenant
from wire.embed_body import Embeddings, EmbedInput
from wire.share import DEFAULT_SHARE, Share

Embed = Callable[[list[str], int | None, str], Awaitable[Embeddings]]


@dataclass(slots=True, frozen=True)
class Embedder:
    """A backend's `embed` and the model it serves the call as."""

    model: str
    embed: Embed


@dataclass(slots=True)
class EmbedPlan:
    """The backends to ask, in order; for an alias, its adapter and this call's route."""

    candidates: list[Embedder]
    alias: FallbackAdapter | None = None
    route: Route | None = None
    share: Share = DEFAULT_SHARE  # the tenant's, at its default tier: weighed as its chats are

    async def embed(
        self, inputs: list[EmbedInput], dimensions: int | None, call_id: str
    ) -> tuple[str, Embeddings]:
        """(the model that served, its answer) from the first candidate that answers."""
        budget = self.alias.budget if self.alias is not None else None
        if budget is not None:
            budget.requested(call_id)
        for n, candidate in enumerate(self.candidates):
            if self.route is not None:
                self.route.trying = candidate.model
            try:
                answer = await candidate.embed(inputs, dimensions, call_id, self.share)
            except (BackendUnavailable, BackendFailed) as exc:
                if not self._hand_on(candidate.model, exc, n + 1 == len(self.candidates)):
                    raise
                continue
            if self.alias is not None and self.route is not None:
                self.alias.count(self.route.serve(candidate.model))
            return candidate.model, answer
        raise AssertionError("a plan has a candidate")  # embed_plan() sees to it

    def _hand_on(self, model: str, exc: Exception, last: bool) -> bool:
        """Whether the call goes on to the next target after `model` failed so."""
        if self.alias is None or self.route is None:
            return False
        budget = self.alias.budget
        if last or (budget is not None and not budget.allow("fallback")):
            self.alias.count("exhausted")
            return False
        self.route.skip(model, "failed" if isinstance(exc, BackendFailed) else "unavailable")
        return True


def embed_plan(request: web.Request, tenant: Tenant, model: str, first: EmbedInput) -> EmbedPlan:
    """The backends to ask, after the tenant's and the backends' checks (an APIError when
    none can be asked). `first`: the call's first input (a weighted alias's stickiness)."""
    adapter = request.app[CATALOG].lookup(model)
    if adapter is None:
        request[MODEL_LABEL] = "unknown"
        raise model_not_found(model)
    request[MODEL_LABEL] = model
    if not tenant.allows_model(model):
        raise _not_allowed(f"Your key has no access to model '{model}'.")
    if isinstance(adapter, FallbackAdapter):
        plan = _alias_plan(request, tenant, adapter, first)
        plan.share = share_for(tenant, None)
        return plan
    embed = getattr(adapter, "embed", None)
    if embed is None:  # a backend with no embeddings
        raise invalid_request("model", f"Model '{model}' does not serve embeddings.")
    if not request.app[HEALTH].ready(adapter):
        raise overloaded(f"No backend for model '{model}' is ready; retry shortly.")
    return EmbedPlan([Embedder(model, embed)], share=share_for(tenant, None))


def _alias_plan(
    request: web.Request, tenant: Tenant, alias: FallbackAdapter, first: EmbedInput
) -> EmbedPlan:
    route = alias.plan(ChatRequest(alias.alias.name, [], prompt=first))
    request[ROUTE] = route  # the x-sluice-route header reads it when the answer goes out
    health, out = request.app[HEALTH], []
    for target in route.order:
        adapter = alias.targets[target]
        embed = getattr(adapter, "embed", None)
        if not tenant.allows_model(target):
            route.skip(target, "not_allowed")
        elif embed is None:
            route.skip(target, "unsupported")
        elif not health.ready(adapter):
            route.skip(target, "unavailable")
        else:
            out.append(Embedder(target, embed))
    if out:
        return EmbedPlan(out, alias, route)
    name, reasons = alias.alias.name, set(route.skipped.values())
    if reasons == {"not_allowed"}:
        raise _not_allowed(f"Your key has no access to any model behind '{name}'.")
    if reasons <= {"not_allowed", "unsupported"}:
        raise invalid_request("model", f"Model '{name}' does not serve embeddings.")
    alias.count("exhausted")
    raise overloaded(f"No backend for model '{name}' is ready; retry shortly.")


def _not_allowed(message: str) -> APIError:
    return APIError(403, message, param="model", code="model_not_allowed")
