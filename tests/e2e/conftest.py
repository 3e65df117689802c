"""One real `sluice serve` (gateway + its own worker on the tiny model) for e2e tests."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from gateway.local_worker import free_port
from tests.support.processes import stop, wait_ready

E2E_KEY = "sk-sluice-e2e"
DISCONNECT_GRACE = 1.0


class Served:
    def __init__(self, port: int, proc: subprocess.Popen) -> None:
        self.port = port
        self.proc = proc
        self.base_url = f"http://127.0.0.1:{port}/v1"
        self.root = f"http://127.0.0.1:{port}"

    def worker_url(self) -> str:
        backends = httpx.get(f"{self.root}/readyz").json()["backends"]
        (name,) = backends
        return "http://127.0.0.1:" + name.rsplit(":", 1)[1]


@pytest.fixture(scope="session")
def served(tiny_model_dir) -> Served:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--api-key",
        E2E_KEY,
        "--port",
        str(port),
        "--max-body-bytes",
        str(256 * 1024),
        "--disconnect-grace",
        str(DISCONNECT_GRACE),
    ]
    proc = subprocess.Popen(cmd, env={**os.environ, "SLUICE_LOG_LEVEL": "warning"})
    wait_ready(proc, f"http://127.0.0.1:{port}/readyz")
    yield Served(port, proc)
    stop(proc)
