"""Soak sluicegate: two replicas sharing a Redis, in front of two local workers, under load,
faults and slow readers; then check the design's promises and print them as a table.

    python deploy/soak/soak.py                              # the default model (make soak)
    python deploy/soak/soak.py --model tiny --warmup 25 --duration 30   # the test model, as CI

Phases: start the processes (soak_cluster.py); warm up with every kind of client (--warmup s),
let everything settle and read each gateway's RSS and open descriptors; soak (--duration s of
--clients clients, soak_clients.py) with, at 30% of it, a SIGKILL of a worker that is running
sequences and, at 60%, Redis killed and started again --redis-outage s later (soak_faults.py);
let every run settle and check (soak_checks.py). Exit status 0 only if every invariant held;
the last line is `summary: {json}`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(1, str(HERE.parent / "locust"))  # sse_frames: the load's own frame checks
sys.path.insert(1, str(ROOT))  # testkit/ (not installed): the probes, the tiny model

import soak_checks as checks  # noqa: E402
from soak_clients import Client, Target  # noqa: E402
from soak_cluster import AUTH, Cluster, ClusterSettings  # noqa: E402
from soak_faults import inject_faults  # noqa: E402
from soak_gather import (  # noqa: E402
    Footprint,
    SocketWatch,
    WorkerTokens,
    generated,
    ledger,
    runs_told,
    workers_idle,
)
from soak_observed import Observed  # noqa: E402

SETTLE = 90.0  # seconds the runs, the ledger and the workers get to settle after the load


class Load:
    """`clients` client threads, each on its own seeded random stream."""

    def __init__(self, target: Target, args: argparse.Namespace, seen: Observed) -> None:
        self.target, self.args, self.seen = target, args, seen
        self.threads: list[threading.Thread] = []
        self.round = 0

    def start(self, seconds: float) -> None:
        stop_at = time.monotonic() + seconds
        self.round += 1
        self.threads = [
            threading.Thread(target=self._client, args=(i, stop_at), daemon=True)
            for i in range(self.args.clients)
        ]
        for thread in self.threads:
            thread.start()

    def join(self) -> None:
        for thread in self.threads:
            thread.join()

    def _client(self, index: int, stop_at: float) -> None:
        client = Client(self.target, self.seen, self.args.seed * 10_000 + self.round * 100 + index)
        try:
            client.loop(stop_at)
        finally:
            client.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sluice-soak-") as tmp:
        folder = Path(args.workdir or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        model = build_tiny(folder) if args.model == "tiny" else args.model
        settings = ClusterSettings(
            folder, model, args.dtype, args.device, args.disconnect_grace, args.outage_grace
        )
        cluster = Cluster(settings)
        began = time.monotonic()
        try:
            cluster.start()
            print(f"started in {time.monotonic() - began:.0f} s; soaking", flush=True)
            rows = soak(cluster, args)
        except RuntimeError as exc:
            print(f"soak: {exc}")
            rows = [checks.Row("the soak ran", str(exc), False)]
        finally:
            cluster.stop()
            logs = {g.name: g.log_path.read_text(errors="replace") for g in cluster.gateways}
    failed = [r.name for r in rows if r.ok is False]
    print(checks.table(rows))
    for row in rows:
        if row.ok is not True and row.detail:
            print(f"{row.name}:\n  " + "\n  ".join(row.detail[:20]))
    for name, text in logs.items():
        errors = [line for line in text.splitlines() if '"level":"error"' in line]
        if errors or failed:
            print(f"replica {name}: {len(errors)} error lines; its log ends:\n{text[-3000:]}")
    took = time.monotonic() - began
    print(
        f"took {took:.0f} s; {'FAIL: ' + ', '.join(failed) if failed else 'every invariant held'}"
    )
    summary = {"ok": not failed, "failed": failed, "seconds": round(took, 1)}
    summary["rows"] = [{"name": r.name, "value": r.value, "ok": r.ok} for r in rows]
    print("summary: " + json.dumps(summary, ensure_ascii=False))
    return 1 if failed else 0


def soak(cluster: Cluster, args: argparse.Namespace) -> list[checks.Row]:
    roots = [g.root for g in cluster.gateways]
    model = httpx.get(f"{roots[0]}/v1/models", headers=AUTH, timeout=5).json()["data"][0]["id"]
    seen, urls = Observed(), cluster.worker_urls
    counted = WorkerTokens(start=generated(urls))
    load = Load(Target(tuple(roots), model, args.profile, args.disconnect_grace), args, seen)

    peers = {cluster.redis.port: "redis", **{int(u.rsplit(":", 1)[1]): "worker" for u in urls}}
    with SocketWatch(cluster.gateways, peers) as sockets:
        load.start(args.warmup)
        load.join()
        runs_told(cluster.gateways, list(seen.runs), SETTLE)
        workers_idle(urls, SETTLE)
        base = {g.name: sockets.steady(g) for g in cluster.gateways}

        began = time.monotonic()
        load.start(args.duration)
        faults = inject_faults(cluster, args, began, counted)
        load.join()

        told = runs_told(cluster.gateways, list(seen.runs), SETTLE)
        billing = ledger(cluster, len(seen.runs), SETTLE)
        stats = workers_idle(urls, SETTLE)
        counted.end = generated(urls)
        end = {g.name: sockets.back(g, base[g.name], 30) for g in cluster.gateways}
    rows = [
        *checks.runs(seen, told),
        *checks.usage(seen, told, billing),
        *checks.tokens(billing, counted),
        *checks.texts(seen, told),
        *checks.greedy(seen, told, strict=args.profile == "tiny"),
        *checks.kv(stats),
    ]
    bounds = pool_bounds(args.clients, len(urls))
    for g in cluster.gateways:
        rows += checks.footprint(g.name, base[g.name], end[g.name], bounds)
        write_descriptors(cluster.settings.folder / f"fds-{g.name}.txt", base[g.name], end[g.name])
    return [*rows, *checks.contract(seen), *faults, *checks.coverage(seen)]


def pool_bounds(clients: int, workers: int) -> dict[str, int]:
    """The most pooled connections a gateway may keep to each kind of peer: every client may
    have a stream on one worker, plus runs left to their disconnect grace, probes and aborts;
    two Redis commands at once per client (a run's writes, a follower's reads), plus the
    pub/sub connection and the lease."""
    return {"worker": workers * (clients + 4), "redis": 2 * clients + 4}


def write_descriptors(path: Path, base: Footprint, end: Footprint) -> None:
    """Every descriptor's kind after warm-up and at the end, for a failed check's reader."""
    lines = [f"after warm-up {fd}: {kind} {to}" for fd, (kind, to) in sorted(base.fds.items())]
    lines += [f"at the end {fd}: {kind} {to}" for fd, (kind, to) in sorted(end.fds.items())]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def build_tiny(folder: Path) -> str:
    from testkit.tiny_model import build_tiny_model

    return str(build_tiny_model(folder / "tiny"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder, 'tiny' (the test model), or serve's default")
    p.add_argument("--duration", type=float, default=180, help="seconds of soak (default 180)")
    # NOTE: 30 s is how long a replica mirrors its ended runs: by then its memory holds as
    # much as it will under this load, so growth after it is growth, not the mirror filling up
    p.add_argument("--warmup", type=float, default=30, help="seconds of warm-up (default 30)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--seed", type=int, default=1, help="the clients' random choices")
    p.add_argument("--disconnect-grace", type=float, default=2.0)
    p.add_argument("--outage-grace", type=float, default=20.0, help="--redis-outage-grace")
    p.add_argument("--redis-outage", type=float, default=3.0, help="seconds Redis stays down")
    p.add_argument("--dtype", help="passed to sluice serve (tiny: float32)")
    p.add_argument("--device", help="passed to sluice serve (tiny: cpu)")
    p.add_argument("--workdir", help="keep logs, ledgers and Redis's files here")
    args = p.parse_args(argv)
    args.profile = "tiny" if args.model == "tiny" else "default"
    if args.model == "tiny":
        args.dtype, args.device = args.dtype or "float32", args.device or "cpu"
    if args.redis_outage >= args.outage_grace:
        p.error("--redis-outage must be shorter than --outage-grace: runs are to ride it out")
    return args


if __name__ == "__main__":
    sys.exit(main())
