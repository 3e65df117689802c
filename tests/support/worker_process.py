"""A real `sluice worker` process on a local model, for integration tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Worker:
    proc: subprocess.Popen
    url: str
    port: int
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(worker: Worker, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert worker.proc.poll() is None, worker.log.read_text()
        try:
            with urllib.request.urlopen(worker.url + "/health", timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.1)  # NOTE: polling another process's start, with a deadline
    raise AssertionError("the worker never became healthy:\n" + worker.log.read_text())


@contextmanager
def running_worker(
    model_dir: Path, log_dir: Path, *flags: str, module: str = "workers.cli"
) -> Iterator[Worker]:
    """`python -m workers.cli --model DIR --dtype float32 FLAGS…` until the block ends
    (`module`: a wrapper of it, such as tests/support/hanging_worker.py)."""
    port = free_port()
    log = log_dir / f"worker-{port}.log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", module, "--model", str(model_dir)]
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [*command, "--port", str(port), "--dtype", "float32", *flags],
            cwd=REPO,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    worker = Worker(proc, f"http://127.0.0.1:{port}", port, log)
    try:
        wait_healthy(worker)
        yield worker
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
