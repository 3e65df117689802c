"""The gateway's backends from its settings (design §1, §6): local workers, `--worker-url`
workers and `--upstream` servers are all members, and the members that serve one model form
that model's pool.

Local workers always form a pool, even one alone: its stream survives the worker's crash by
continuing on the restarted worker. A model served by one remote member only is that member,
unwrapped. An adapter that serves several models (an OpenAI-compatible upstream) is a member of
each of their pools and routes the rest of its models itself.
"""

from __future__ import annotations

import os

from adapters.base import Adapter
from adapters.openai_upstream import OpenAIUpstreamAdapter
from adapters.pool import PoolAdapter
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
    local: set[str],
    supervisor: Supervisor | None,
) -> list[Adapter]:
    """What the catalog routes to, from started members: a pool per model that several members
    (or any local worker) serve, first, then the members as themselves for their other models.
    `local` names the members that are local workers."""
    serving: dict[str, list[Adapter]] = {}
    for member in members:
        for info in await member.models():
            serving.setdefault(info.id, []).append(member)
    pools: list[PoolAdapter] = []
    for model, adapters in serving.items():
        if len(adapters) > 1 or any(a.name in local for a in adapters):
            pools.append(
                PoolAdapter(
                    adapters,
                    f"pool:{model}",
                    model=model,
                    routing=settings.pool_routing,
                    stall_timeout=settings.stall_timeout,
                    on_stall=supervisor.restart if supervisor is not None else None,
                )
            )
    if supervisor is not None:
        supervisor.exit_listeners.extend(pool.member_exited for pool in pools)
    pooled = {pool.model for pool in pools}
    alone = [m for m in members if any(m in serving[model] for model in serving.keys() - pooled)]
    return pools + alone
