"""Real `sluice serve` processes for tests: start one on the tiny model, find its worker."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from gateway.backends.local_worker import free_port
from tests.support.processes import stop, wait_ready


def local_worker_url(root: str) -> str:
    """The URL of the gateway's one local worker, a member of its model's pool (`local:PORT`)."""
    text = httpx.get(f"{root}/metrics").text
    (member,) = {
        s.labels["member"]
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "sluice_pool_member_healthy" and s.labels["member"].startswith("local:")
    }
    return "http://127.0.0.1:" + member.rsplit(":", 1)[1]


class Served:
    """A running gateway: its port, process, and URLs."""

    def __init__(self, port: int, proc: subprocess.Popen, key: str) -> None:
        self.port = port
        self.proc = proc
        self.key = key
        self.auth = {"Authorization": f"Bearer {key}"}
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.root = f"http://127.0.0.1:{port}"

    def worker_url(self) -> str:
        return local_worker_url(self.root)

    def worker_process(self) -> psutil.Process:
        """The local worker child (one, started with the gateway)."""
        (child,) = [
            p for p in psutil.Process(self.proc.pid).children() if "workers.cli" in p.cmdline()
        ]
        return child


def serve_command(model_dir: Path, port: int, key: str, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--api-key",
        key,
        "--port",
        str(port),
        *flags,
    ]


@contextmanager
def serving(
    model_dir: Path | None,
    *flags: str,
    key: str = "sk-sluice-test-serve",
    env: dict[str, str] | None = None,
    stdout=None,
    stderr=None,
) -> Iterator[Served]:
    """`sluice serve` on the tiny model (or, with `model_dir` None, only on what `flags` name)
    until the block ends."""
    port = free_port()
    if model_dir is not None:
        cmd = serve_command(model_dir, port, key, *flags)
    else:
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--api-key", key]
        cmd += ["--port", str(port), *flags]
    # a test's stop (SIGTERM) drains: a run still live is cancelled after 2 s, not 30
    defaults = {"SLUICE_LOG_LEVEL": "warning", "SLUICE_SHUTDOWN_TIMEOUT": "2"}
    environ = {**defaults, **os.environ, **(env or {})}
    proc = subprocess.Popen(cmd, env=environ, stdout=stdout, stderr=stderr)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}/readyz")
        yield Served(port, proc, key)
    finally:
        stop(proc)
