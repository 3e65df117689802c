"""Real `sluice` processes for tests: wait until one answers, stop it, and the resume request."""

from __future__ import annotations

import signal
import subprocess
import time

import httpx
import pytest


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
