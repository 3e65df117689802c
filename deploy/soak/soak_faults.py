"""The soak's faults, at their moments: a SIGKILL of a worker while it runs sequences (its
supervisor, replica A, starts it again; both replicas continue its runs on the other worker),
and Redis killed and started again on its port a few seconds later, within the replicas'
outage grace. Each fault's rows say whether it happened as meant."""

from __future__ import annotations

import argparse
import time

import httpx
from soak_checks import Row
from soak_cluster import Cluster, metric, poll
from soak_gather import WorkerTokens, kill_counted

KILL_AT, REDIS_AT = 0.3, 0.6  # fractions of --duration


def inject_faults(
    cluster: Cluster, args: argparse.Namespace, began: float, counted: WorkerTokens
) -> list[Row]:
    """The worker kill and the Redis restart, at their moments of the soak; their rows."""
    victim, other = cluster.worker_urls
    pids = {url: cluster.worker_pid(url) for url in cluster.worker_urls}
    _sleep_until(began + KILL_AT * args.duration)
    running = kill_counted(victim, counted, lambda: cluster.kill_worker(victim))
    killed_at = time.monotonic()
    back = poll(lambda: _serving(cluster, victim, pids[victim]), 120, 0.2)
    back_in = time.monotonic() - killed_at

    _sleep_until(began + REDIS_AT * args.duration)
    away = cluster.restart_redis(args.redis_outage)
    restarts = metric(cluster.gateways[0].root, "sluice_local_worker_restarts_total")
    new_pid = cluster.worker_pid(victim)
    restarted = bool(back) and new_pid not in (None, pids[victim]) and restarts == 1
    restarted = restarted and running > 0 and cluster.worker_pid(other) == pids[other]
    value = f"pid {pids[victim]} → {new_pid} ({running} sequences running at the kill)"
    return [
        Row(
            "a worker SIGKILLed mid-stream, restarted",
            f"{value}, back in {back_in:.1f} s, restarts {restarts:.0f}",
            restarted,
        ),
        Row(
            "Redis SIGKILLed and started again",
            f"away {away:.1f} s (outage grace {args.outage_grace:.0f} s)",
            away < args.outage_grace,
        ),
        *migrations(cluster),
    ]


def migrations(cluster: Cluster) -> list[Row]:
    """Runs on the killed worker continued on the other, on both replicas, none lost."""
    per = {
        outcome: sum(
            metric(g.root, "sluice_run_migrations_total", outcome=outcome) for g in cluster.gateways
        )
        for outcome in ("continued", "failed", "not_continuable")
    }
    value = ", ".join(f"{k} {v:.0f}" for k, v in per.items())
    ok = per["continued"] >= 1 and per["failed"] == per["not_continuable"] == 0
    return [Row("runs moved off the killed worker", value, ok)]


def _serving(cluster: Cluster, url: str, dead_pid: int | None) -> bool:
    """A new process serves `url`, and both replicas route to it again."""
    if cluster.worker_pid(url) in (None, dead_pid):
        return False
    if httpx.get(f"{url}/health", timeout=2).status_code != 200:
        return False
    member = {"local:" + url.rsplit(":", 1)[1], f"worker:{url}"}
    return all(
        sum(metric(g.root, "sluice_pool_member_healthy", member=m) for m in member) == 1
        for g in cluster.gateways
    )


def _sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))  # NOTE: the schedule of the faults
