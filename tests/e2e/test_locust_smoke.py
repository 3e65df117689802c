"""The load of deploy/locust/ against a real `sluice serve` on the tiny model, for 20 seconds.

The runner exits 0 only if locust recorded no failure and every kind of request happened; the
test also reads its summary, so a load that quietly stopped cancelling or resuming fails here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

# alone (tests/support/tiers.py): it loads the host by design
pytestmark = pytest.mark.alone

RUNNER = Path(__file__).resolve().parents[2] / "deploy" / "locust" / "run_local.py"
RUN_TIME = 20


def run_load(model_dir: Path) -> tuple[int, str]:
    cmd = [sys.executable, str(RUNNER), "--model", str(model_dir), "--run-time", str(RUN_TIME)]
    cmd += ["--users", "6", "--dtype", "float32", "--device", "cpu"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIME + 150, check=False)
    return done.returncode, done.stdout + done.stderr


def test_the_load_runs_clean_and_exercises_every_kind(tiny_model_dir):
    began = time.monotonic()
    rc, output = run_load(tiny_model_dir)
    took = time.monotonic() - began
    assert rc == 0, output[-6000:]
    (line,) = [line for line in output.splitlines() if line.startswith("summary: ")]
    summary = json.loads(line.removeprefix("summary: "))
    assert summary["ok"] and summary["failures"] == 0 and summary["missing"] == []
    for kind in (
        "ttft_samples",
        "itl_samples",
        "streams",
        "cancels",
        "resumes",
        "idempotent_repeats",
        "expected_429s",
        "gateway_client_cancels",
        "gateway_resumes",
        "gateway_idempotent_replays",
        "gateway_quota_rejections",
    ):
        assert summary[kind] > 0, (kind, summary)
    assert summary["gateway_5xx"] == 0
    # locust's own table carries the rows of our own
    assert any(line.startswith("TTFT ") for line in output.splitlines()), output[-4000:]
    assert any(line.startswith("ITL ") for line in output.splitlines()), output[-4000:]
    assert took < RUN_TIME + 120, f"the smoke took {took:.0f} s"
