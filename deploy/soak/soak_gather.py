"""What the soak reads back from the processes once its load has stopped: every run as each
replica tells it, the usage ledger, the workers' own counters and caches, the gateways' memory
and descriptors. Each waits on its condition with a deadline, then returns what it found."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import redis
from soak_cluster import AUTH, Cluster, Gateway, metric, poll

from gateway.state.ledger import UsageRecord

TERMINAL = ("completed", "cancelled", "timed_out", "failed")
GENERATED = "sluice_worker_generated_tokens_total"


@dataclass(slots=True)
class RunTold:
    """One run as the replicas answer `GET /v1/chat/completions/{id}`."""

    statuses: tuple[str | None, ...]  # per replica; None: not a 200
    text: str | None  # the stored message content (first choice), from the first replica


def runs_told(gateways: list[Gateway], run_ids: list[str], within: float) -> dict[str, RunTold]:
    """Every run from every replica, asked again until all are terminal or `within` passes."""
    told: dict[str, RunTold] = {}
    deadline = time.monotonic() + within
    with httpx.Client(timeout=10, headers=AUTH) as http:
        pending = list(run_ids)
        while pending:
            for run_id in pending:
                told[run_id] = _ask(http, gateways, run_id)
            pending = [r for r in pending if not _settled(told[r])]
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(0.5)  # NOTE: runs left to end by themselves (grace, tail), asked again
    return told


def _ask(http: httpx.Client, gateways: list[Gateway], run_id: str) -> RunTold:
    statuses, text = [], None
    for i, gateway in enumerate(gateways):
        resp = http.get(f"{gateway.root}/v1/chat/completions/{run_id}")
        body = resp.json() if resp.status_code == 200 else {}
        statuses.append(body.get("status"))
        if i == 0 and body.get("choices"):
            text = body["choices"][0]["message"].get("content")
    return RunTold(tuple(statuses), text)


def _settled(told: RunTold) -> bool:
    return all(s in TERMINAL for s in told.statuses)


@dataclass(frozen=True, slots=True)
class Ledger:
    """The usage ledger, raw: the Redis stream `{prefix}usage` and the replicas' fallback files
    (what each wrote while Redis was away), a record twice staying twice."""

    stream: list[UsageRecord]
    files: list[UsageRecord]

    def billed(self) -> dict[str, UsageRecord]:
        """One record per run, as `sluice usage` reads the ledger: the stream's, else a file's.
        (A record whose write to Redis timed out may have landed all the same, and also in
        the fallback file; the reader counts that run once.)"""
        runs = {r.run_id: r for r in self.files}
        runs.update((r.run_id, r) for r in self.stream)
        return runs


def ledger(cluster: Cluster, want: int, within: float) -> Ledger:
    """The ledger, read again until it bills `want` runs or `within` passes."""

    def read() -> Ledger | None:
        found = _read_ledger(cluster)
        return found if len(found.billed()) >= want else None

    return poll(read, within, every=0.5) or _read_ledger(cluster)


def _read_ledger(cluster: Cluster) -> Ledger:
    stream: list[UsageRecord] = []
    client = redis.Redis.from_url(cluster.redis.url)
    try:
        start = "-"
        while entries := client.xrange(f"{cluster.prefix}usage", min=start, count=1000):
            stream += [UsageRecord.from_json(fields[b"r"]) for _, fields in entries]
            start = "(" + entries[-1][0].decode()
    finally:
        client.close()
    files: list[UsageRecord] = []
    for gateway in cluster.gateways:
        path: Path = cluster.usage_file(gateway.name)
        if path.exists():
            lines = path.read_bytes().splitlines()
            files += [UsageRecord.from_json(line) for line in lines if line.strip()]
    return Ledger(stream, files)


@dataclass(slots=True)
class WorkerTokens:
    """`sluice_worker_generated_tokens_total` over the soak, per worker URL. A killed worker's
    counter starts again from 0, so its first life is counted up to a scrape just before the
    kill; `allowance` is what it could have made (or made and not delivered) after it."""

    start: dict[str, float] = field(default_factory=dict)
    end: dict[str, float] = field(default_factory=dict)
    victim: str | None = None
    at_kill: float = 0.0
    allowance: float = 0.0

    @property
    def total(self) -> float:
        total = sum(self.end[url] - self.start[url] for url in self.end if url != self.victim)
        if self.victim is not None:
            total += (self.at_kill - self.start[self.victim]) + self.end[self.victim]
        return total


def generated(urls: list[str]) -> dict[str, float]:
    return {url: metric(url, GENERATED) for url in urls}


def kill_counted(
    url: str, tokens: WorkerTokens, kill: Callable[[], None], within: float = 10.0
) -> int:
    """Kill the worker at `url` while it runs sequences, with its counter read just before:
    twice, half a second apart, the second right before `kill()`. Sequences can all end in
    that half second, so the pair is read again until the second read finds one running (or
    `within` s pass). The allowance is its token rate times the time from that read to the
    kill, plus one step of every sequence it ran (made, maybe not delivered). Returns how many
    sequences it was running."""
    deadline = time.monotonic() + within
    while True:
        first, first_at = metric(url, GENERATED), time.monotonic()
        time.sleep(0.5)  # NOTE: the interval the victim's token rate is measured over
        running = httpx.get(f"{url}/v1/stats", timeout=5).json()["running"]
        read_at = time.monotonic()
        if running > 0 or read_at >= deadline:
            break
    tokens.at_kill = metric(url, GENERATED)
    kill()
    window = time.monotonic() - read_at
    rate = (tokens.at_kill - first) / max(read_at - first_at, 1e-3)
    tokens.victim = url
    tokens.allowance = running + rate * window
    return running


def workers_idle(urls: list[str], within: float) -> dict[str, dict]:
    """Each worker's `/v1/stats`, asked again until none runs, waits or holds a KV block."""

    def stats() -> dict[str, dict]:
        return {url: httpx.get(f"{url}/v1/stats", timeout=5).json() for url in urls}

    def idle() -> dict[str, dict] | None:
        now = stats()
        quiet = all(s["running"] == s["waiting"] == s["kv_blocks_used"] == 0 for s in now.values())
        return now if quiet else None

    return poll(idle, within, every=0.5) or stats()


POOLED = ("worker", "redis")  # connections kept in the gateway's pools, idle or not


@dataclass(frozen=True, slots=True)
class Footprint:
    """A gateway's resident memory and what each of its open descriptors is."""

    rss: int
    fds: dict[int, tuple[str, str]]  # fd → (kind, target): Gateway.descriptors
    gone: dict[int, str] = field(default_factory=dict)  # fd → what a socket whose peer is gone was

    @property
    def kinds(self) -> dict[int, str]:
        return {fd: kind for fd, (kind, _) in self.fds.items()}

    def count(self, *kinds: str) -> int:
        return sum(1 for kind in self.kinds.values() if kind in kinds)

    @property
    def own(self) -> int:
        """Descriptors but pooled connections and the ledger file: files, pipes, the event
        loop's, listening and client sockets. None of these is kept for later use."""
        return sum(1 for kind in self.kinds.values() if kind not in (*POOLED, "ledger file"))


class SocketWatch:
    """What each TCP socket of the gateways was, sampled twice a second while the soak runs, so
    a socket still open that the kernel no longer lists as connected (its peer closed or reset
    it: an `other socket`) is known by what it last was. One that was a pooled connection is
    counted with its pool; any other stays an `other socket`, the gateway's own."""

    def __init__(self, gateways: list[Gateway], peers: dict[int, str]) -> None:
        self.gateways, self.peers = gateways, peers
        self.last: dict[tuple[str, str], tuple[str, str]] = {}  # (gateway, target) → (kind, what)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> SocketWatch:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            for gateway in self.gateways:
                with contextlib.suppress(psutil.Error):
                    for target, seen in gateway.sockets(self.peers).items():
                        self.last[(gateway.name, target)] = seen

    def footprint(self, gateway: Gateway) -> Footprint:
        fds, gone = gateway.descriptors(self.peers), {}
        for fd, (kind, target) in fds.items():
            if kind == "other socket":
                was, what = self.last.get((gateway.name, target), ("other socket", "never seen"))
                gone[fd] = what
                if was in POOLED:
                    fds[fd] = (was, target)
        return Footprint(gateway.footprint()[0], fds, gone)

    def steady(self, gateway: Gateway, within: float = 20.0) -> Footprint:
        """The footprint once the gateway's own descriptors hold still for two seconds (client
        connections closed), or after `within`."""
        samples = [self.footprint(gateway)]
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            time.sleep(1.0)  # NOTE: sampling another process
            samples.append(self.footprint(gateway))
            if len(samples) >= 3 and samples[-1].own == samples[-2].own == samples[-3].own:
                break
        return samples[-1]

    def back(self, gateway: Gateway, base: Footprint, within: float) -> Footprint:
        """The footprint, asked again until RSS and the gateway's own descriptors are back
        within 10% of `base`, or `within` passes."""

        def back() -> Footprint | None:
            now = self.footprint(gateway)
            return now if now.rss <= base.rss * 1.1 and now.own <= base.own * 1.1 else None

        return poll(back, within, every=1.0) or self.footprint(gateway)
