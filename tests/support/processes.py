"""Real `sluice` processes for tests: wait until one answers, stop it, the scripted upstream as
a process of its own, and the resume request."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from gateway.backends.local_worker import free_port


def wait_ready(proc: subprocess.Popen, ready_url: str, timeout: float = 120.0) -> None:
    """Poll `ready_url` until it answers 200; fail the test if the process exits or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args} exited during start-up with {proc.returncode}")
        try:
            if httpx.get(ready_url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)  # NOTE: polling another process's start, with a deadline
    stop(proc)
    pytest.fail(f"{proc.args} did not become ready at {ready_url}")


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it does not exit in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextmanager
def scripted_upstream_process() -> Iterator[str]:
    """The scripted OpenAI-compatible upstream (testkit/scripted_upstream.py) as its own
    process until the block ends; its base URL (`…/v1`)."""
    port = free_port()
    cmd = [sys.executable, "-m", "testkit.scripted_upstream", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}/v1/models")
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop(proc)


def resume_request(after: int, header: bool, auth: dict[str, str]) -> tuple[dict, dict]:
    """(query params, headers) of a resume after event `after`: by `starting_after` or by the
    `Last-Event-ID` header."""
    params = {"stream": "true"}
    headers = dict(auth)
    if header:
        headers["Last-Event-ID"] = str(after)
    else:
        params["starting_after"] = str(after)
    return params, headers
