"""The soak's processes: a private Redis, two `sluice serve` replicas sharing it, and the two
local workers of replica A, which both replicas route to.

Topology (why): replica A runs `--workers 2`, so it starts and supervises the workers; replica
B starts none and names A's two workers with `--worker-url`. Both replicas therefore pool the
same two members: a SIGKILLed worker costs each replica its runs on it, which continue on the
other member from the exact token (a migration on both replicas), and A's supervisor starts the
killed worker again on the same port, where both replicas find it once it answers.

Redis keeps an append-only file, so a SIGKILL and a start on the same port bring back
everything it acknowledged (it writes the file before it answers; `everysec` fsyncs, which only
an OS crash needs), as a production Redis with persistence does: the
ledger's stream and every run record outlive the outage, so every run can be checked after it.
(A Redis that restarts empty is tests/integration/test_redis_outage.py's.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from gateway.backends.local_worker import free_port
from testkit.probes import redis_answers, scraped

API_KEY = "sk-sluice-soak"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
READY_WITHIN = 600.0  # the default model's first start converts it (about 20 s on a fast host)


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    folder: Path
    model: str | None  # None: serve's default model
    dtype: str | None
    device: str | None
    disconnect_grace: float
    outage_grace: float


metric = scraped  # one sample of a process's /metrics


def poll(check, within: float, every: float = 0.2):
    """The first truthy value of `check()` within `within` seconds, else its last value (an
    HTTP error counts as a falsy value: the process asked may be down for now)."""
    deadline = time.monotonic() + within
    while True:
        try:
            value = check()
        except httpx.HTTPError:
            value = None
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(every)  # NOTE: another process's state, asked again until a deadline


class SoakRedis:
    """`redis-server` on a port of its own, its data in an append-only file under `folder`."""

    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.folder = folder
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                *("redis-server", "--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "yes", "--appendfsync", "everysec"),
                *("--dir", str(self.folder)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if not poll(self.answers, 15, every=0.02):
            raise RuntimeError(f"redis-server did not start on port {self.port}")

    def answers(self) -> bool:
        return redis_answers(self.port)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@dataclass(slots=True)
class Gateway:
    name: str
    port: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def footprint(self) -> tuple[int, int]:
        """(resident bytes, open file descriptors) of the gateway process itself."""
        process = psutil.Process(self.proc.pid)
        return process.memory_info().rss, process.num_fds()

    def descriptors(self, peers: dict[int, str]) -> dict[int, tuple[str, str]]:
        """Each open descriptor: (what it is, what it points at). What it is: a socket by its
        peer (`peers` names the peers' ports: `worker`, `redis`; `client` for connections to
        this gateway), the ledger file, or its kind (`file`, `pipe`, `eventpoll`, `eventfd`,
        `unix socket`; `other socket` for one the kernel no longer lists as connected)."""
        process = psutil.Process(self.proc.pid)
        sockets = {c.fd: c for c in process.net_connections(kind="all")}
        fds = {}
        for fd_path in Path(f"/proc/{self.proc.pid}/fd").iterdir():
            try:
                target = os.readlink(fd_path)
            except OSError:
                continue  # closed meanwhile
            fd = int(fd_path.name)
            fds[fd] = (self._kind(target, sockets.get(fd), peers), target)
        return fds

    def sockets(self, peers: dict[int, str]) -> dict[str, tuple[str, str]]:
        """Each TCP socket now, by what it points at (`socket:[inode]`): (its kind as
        `descriptors` names it, its ports and state)."""
        described = {}
        for c in psutil.Process(self.proc.pid).net_connections(kind="inet"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{self.proc.pid}/fd/{c.fd}")
                far = f":{c.raddr.port}" if c.raddr else "-"
                kind = self._kind(target, c, peers)
                described[target] = (kind, f"{kind} {far} from :{c.laddr.port} {c.status}")
        return described

    def _kind(self, target: str, conn, peers: dict[int, str]) -> str:
        if target.startswith("socket:"):
            if conn is None:
                return "other socket"
            if conn.family == socket.AF_UNIX:
                return "unix socket"
            if not conn.raddr:
                return (
                    "listening" if conn.laddr and conn.laddr.port == self.port else "other socket"
                )
            if conn.laddr.port == self.port:
                return "client"
            return peers.get(conn.raddr.port, "other socket")
        if target.startswith("pipe:"):
            return "pipe"
        if target.startswith("anon_inode:"):
            return target.removeprefix("anon_inode:").strip("[]")
        return "ledger file" if target.endswith(f"usage-{self.name}.jsonl") else "file"

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.root}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


class Cluster:
    """Redis, replica A with its two workers, replica B; started together, stopped together."""

    def __init__(self, settings: ClusterSettings) -> None:
        self.settings = settings
        self.redis = SoakRedis(settings.folder / "redis")
        self.prefix = f"sluice-soak-{uuid.uuid4().hex[:8]}:"
        self.gateways: list[Gateway] = []
        self.worker_urls: list[str] = []

    def start(self) -> None:
        self.redis.start()
        a = self._serve("a", ["--workers", "2", *self._model_flags()])
        self._wait_ready(a)
        members = poll(lambda: self._local_members(a), 30)
        if len(members) != 2:
            raise RuntimeError(f"replica a pools {members}, not its two local workers")
        self.worker_urls = [f"http://127.0.0.1:{port}" for port in members]
        b = self._serve("b", [arg for url in self.worker_urls for arg in ("--worker-url", url)])
        self._wait_ready(b)

    def stop(self) -> None:
        for gateway in reversed(self.gateways):  # b first: a owns the workers
            if gateway.proc.poll() is None:
                gateway.proc.send_signal(signal.SIGTERM)
                try:
                    gateway.proc.wait(30)
                except subprocess.TimeoutExpired:
                    gateway.proc.kill()
                    gateway.proc.wait(10)
        self.redis.stop()

    # -- the faults -----------------------------------------------------------------------------

    def worker_pid(self, url: str) -> int | None:
        """The process of A's local worker listening at `url` (None while it is down)."""
        port = url.rsplit(":", 1)[1]
        for child in psutil.Process(self.gateways[0].proc.pid).children():
            try:
                cmdline = child.cmdline()
            except psutil.Error:  # gone, or a zombie not yet reaped by its supervisor
                continue
            if "workers.cli" in cmdline and port in cmdline:
                return child.pid
        return None

    def kill_worker(self, url: str) -> None:
        pid = self.worker_pid(url)
        if pid is None:
            raise RuntimeError(f"no worker process serves {url}")
        os.kill(pid, signal.SIGKILL)

    def restart_redis(self, outage: float) -> float:
        """SIGKILL Redis, start it again on its port `outage` seconds later; the seconds it
        was really away."""
        began = time.monotonic()
        self.redis.kill()
        time.sleep(outage)  # NOTE: the outage's length is the point, not a wait for something
        self.redis.start()
        return time.monotonic() - began

    # -- starting -------------------------------------------------------------------------------

    def _model_flags(self) -> list[str]:
        s = self.settings
        flags = ["--model", s.model] if s.model else []
        for flag, value in (("--dtype", s.dtype), ("--device", s.device)):
            if value:
                flags += [flag, value]
        return flags

    def _serve(self, name: str, flags: list[str]) -> Gateway:
        s = self.settings
        port = free_port()
        log_path = s.folder / f"serve-{name}.log"
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)]
        cmd += ["--api-key", API_KEY, "--redis-url", self.redis.url, "--redis-prefix", self.prefix]
        cmd += ["--usage-file", str(self.usage_file(name))]
        cmd += ["--disconnect-grace", str(s.disconnect_grace)]
        cmd += ["--redis-outage-grace", str(s.outage_grace), *flags]
        # a stop drains: a run still live after 2 s is cancelled, not after 30
        env = {"SLUICE_LOG_LEVEL": "info", **os.environ, "SLUICE_SHUTDOWN_TIMEOUT": "2"}
        with log_path.open("wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env)
        gateway = Gateway(name, port, proc, log_path)
        self.gateways.append(gateway)
        return gateway

    def usage_file(self, name: str) -> Path:
        """Replica `name`'s ledger file: the records it wrote while Redis was away."""
        return self.settings.folder / f"usage-{name}.jsonl"

    def _wait_ready(self, gateway: Gateway) -> None:
        ready = poll(lambda: gateway.proc.poll() is not None or gateway.ready(), READY_WITHIN)
        if gateway.proc.poll() is not None or not ready:
            raise RuntimeError(f"replica {gateway.name} did not become ready; see its log")

    @staticmethod
    def _local_members(gateway: Gateway) -> list[str]:
        text = httpx.get(f"{gateway.root}/metrics", timeout=5).text
        return sorted(
            {
                s.labels["member"].rsplit(":", 1)[1]
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name == "sluice_pool_member_healthy" and s.value == 1
            }
        )
