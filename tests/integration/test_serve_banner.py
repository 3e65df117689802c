"""`sluice serve` with no key generates one and prints a snippet for the model it really serves."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx

from gateway.backends.local_worker import free_port
from tests.support.processes import stop


def test_the_banner_names_the_served_model_and_its_key_works(tiny_model_dir):
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--model", str(tiny_model_dir)]
    cmd += ["--dtype", "float32", "--device", "cpu", "--port", str(port)]
    env = {**os.environ, "SLUICE_LOG_LEVEL": "warning"}
    env.pop("SLUICE_API_KEY", None)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 120
        while not any(line.startswith("sluicegate ready") for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, lines
            lines.append(proc.stdout.readline())
        banner = "".join(lines)
        model = tiny_model_dir.name
        assert f'model="{model}"' in banner and "SmolLM2" not in banner
        key = next(line.strip() for line in lines if line.strip().startswith("sk-sluice-"))
        models = httpx.get(
            f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {key}"}
        ).json()
        assert [m["id"] for m in models["data"]] == [model]
        assert abs(models["data"][0]["created"] - time.time()) < 600  # when it was loaded
    finally:
        stop(proc)
        proc.stdout.close()
