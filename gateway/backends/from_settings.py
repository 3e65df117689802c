"""The gateway's backends from its settings (design §1, §6): local workers, `--worker-url`
workers and `--upstream` servers are all members, and the members that serve one model form
that model's pool.

Every model gets a pool, even one a single member serves: its members' circuit breakers, the
gateway's retry budget (one, shared by every pool), the retry-after an upstream asks for and
the continuation of a cut run (on the restarted local worker, or the same upstream from the
text so far) apply alike to all. An adapter that serves several models (an OpenAI-compatible
upstream) is a member of each of their pools.
"""

from __future__ import annotations

import os

from adapters.base import Adapter
from adapters.openai_upstream import OpenAIUpstreamAdapter
from adapters.pool import PoolAdapter
from adapters.retry_budget import RetryBudget
from adapters.worker_client import WorkerAdapter
from gateway.backends.local_worker import LocalWorker
from gateway.backends.supervisor import Supervisor
from gateway.settings import DEFAULT_MODEL, Settings


def local_workers(settings: Settings) -> list[LocalWorker]:
    """The worker processes this gateway starts (none when only remote members were named)."""
    if not settings.starts_local_workers:
        return []
    model = settings.model or DEFAULT_MODEL
    return [
        LocalWorker(
            model,
            settings.device,
            settings.dtype,
            settings.max_body_bytes,
            scheduling=settings.scheduling,
            engine=settings.worker,
            otlp_endpoint=settings.otlp_endpoint,
        )
        for _ in range(max(1, settings.workers))
    ]


def member_adapters(settings: Settings, workers: list[LocalWorker]) -> list[Adapter]:
    """An adapter per member: local workers first, then `--worker-url`, then `--upstream`."""
    members: list[Adapter] = [WorkerAdapter(w.url, name=w.name) for w in workers]
    members += [WorkerAdapter(url, name=f"worker:{url}") for url in settings.worker_url]
    for spec in settings.upstream_specs():
        key = os.environ.get(f"SLUICE_UPSTREAM_API_KEY_{spec.name.upper().replace('-', '_')}")
        members.append(
            OpenAIUpstreamAdapter(spec.name, spec.url, api_key=key, capacity=spec.capacity)
        )
    return members


async def routed_backends(
    settings: Settings,
    members: list[Adapter],
    supervisor: Supervisor | None,
    budget: RetryBudget | None = None,
) -> list[Adapter]:
    """What the catalog routes to, from started members: a pool per model, of the members
    that serve it. `budget`: the gateway's retry budget, which every pool shares."""
    serving: dict[str, list[Adapter]] = {}
    for member in members:
        for info in await member.models():
            serving.setdefault(info.id, []).append(member)
    pools: list[PoolAdapter] = []
    budget = budget or RetryBudget(settings.retry_budget)
    for model, adapters in serving.items():
        pools.append(
            PoolAdapter(
                adapters,
                f"pool:{model}",
                model=model,
                routing=settings.pool_routing,
                stall_timeout=settings.stall_timeout,
                on_stall=supervisor.restart if supervisor is not None else None,
                crash_looping=supervisor.crash_looping if supervisor is not None else None,
                retry_budget=budget,
            )
        )
    if supervisor is not None:
        supervisor.exit_listeners.extend(pool.member_exited for pool in pools)
    return list(pools)
