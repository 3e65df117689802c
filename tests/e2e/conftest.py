"""One real `sluice serve` (gateway + its own worker on the tiny model) for e2e tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from gateway.local_worker import free_port

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
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, "sluice serve exited during start-up"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("sluice serve did not become ready")
    yield Served(port, proc)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
