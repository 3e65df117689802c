"""The soak (deploy/soak/) for a minute on the tiny model: two replicas sharing a private Redis,
two workers, every kind of client, a worker SIGKILLed mid-stream and Redis restarted mid-run.
It must exit 0 with every invariant of its table held; and its checks must fail on data that
breaks them (a soak that cannot fail proves nothing)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.state.ledger import UsageRecord

# alone (tests/support/tiers.py): it loads the host by design
pytestmark = pytest.mark.alone

ROOT = Path(__file__).resolve().parents[2]
SOAK = ROOT / "deploy" / "soak"
WARMUP, DURATION = 25, 30
INVARIANTS = (
    "runs in one terminal state (both replicas agree)",
    "terminal state is what its client saw",
    "usage records, exactly one per run",
    "runs in the stream and a fallback file (the reader counts one)",
    "usage record's status is the run's",
    "generated tokens: ledger == workers' counters",
    "resumed streams' text == stored text",
    "other streams' text == stored text",
    "greedy runs of one prompt say the same",
    "KV blocks used after, per worker (none running)",
    "gateway a RSS after warm-up → end",
    "gateway a own fds after warm-up → end",
    "gateway a pooled connections",
    "gateway b RSS after warm-up → end",
    "gateway b own fds after warm-up → end",
    "gateway b pooled connections",
    "answers outside the contract",
    "a worker SIGKILLed mid-stream, restarted",
    "Redis SIGKILLed and started again",
    "runs moved off the killed worker",
    "runs per kind of client",
)


def _run_in_own_group(cmd: list[str], timeout: float) -> tuple[int, str, str]:
    """Run the soak in a process group of its own, and kill that group when it is done: the
    soak's gateways, workers and Redis never outlive the test, even when it runs past
    `timeout` (before pytest's own timeout, which would leave them running)."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the soak ran past {timeout:.0f} s:\n{(stdout + stderr)[-8000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything of the soak's still running
    return proc.returncode, stdout, stderr


def test_the_soak_holds_every_invariant(tmp_path):
    cmd = [sys.executable, str(SOAK / "soak.py"), "--model", "tiny", "--clients", "6"]
    cmd += ["--warmup", str(WARMUP), "--duration", str(DURATION), "--workdir", str(tmp_path)]
    began = time.monotonic()
    returncode, stdout, stderr = _run_in_own_group(cmd, timeout=WARMUP + DURATION + 200)
    took = time.monotonic() - began
    output = stdout + stderr
    assert returncode == 0, output[-8000:]
    (line,) = [line for line in stdout.splitlines() if line.startswith("summary: ")]
    summary = json.loads(line.removeprefix("summary: "))
    assert summary["ok"] and summary["failed"] == []
    rows = {row["name"]: row for row in summary["rows"]}
    assert [name for name in INVARIANTS if rows[name]["ok"] is not True] == [], rows
    assert int(rows["runs started"]["value"]) >= 50, rows["runs started"]
    assert took < WARMUP + DURATION + 120, f"the soak took {took:.0f} s"


@pytest.fixture
def checks(monkeypatch):
    """deploy/soak/soak_checks.py, importable as the soak imports it."""
    monkeypatch.syspath_prepend(str(ROOT / "deploy" / "locust"))
    monkeypatch.syspath_prepend(str(SOAK))
    import soak_checks

    return soak_checks


def _world():
    """Two runs seen, told and billed consistently: every check passes on them."""
    from soak_gather import Ledger, RunTold, WorkerTokens
    from soak_observed import Observed, Seen

    seen = Observed()
    seen.add(Seen("chatcmpl-1", "resume", 0, text="héllo 你好", resumes=2))
    seen.add(Seen("chatcmpl-2", "plain", 0, text="héllo 你好"))
    told = {r: RunTold(("completed", "completed"), "héllo 你好") for r in seen.runs}

    def record(run_id: str, generated: int) -> UsageRecord:
        return UsageRecord(
            run_id=run_id,
            tenant="default",
            principal="key_1",
            model="tiny",
            status="completed",
            finish_reason="length",
            cancel_source=None,
            prompt_tokens=5,
            generated_tokens=generated,
            sent_tokens=generated,
            tail_tokens=0,
            ttft_s=0.01,
            e2e_s=0.5,
            ended_at=0.0,
        )

    records = Ledger(stream=[record("chatcmpl-1", 7)], files=[record("chatcmpl-2", 9)])
    tokens = WorkerTokens(start={"w": 100.0}, end={"w": 116.0})
    return seen, told, records, tokens, record


def _verdicts(checks, seen, told, records, tokens) -> dict[str, bool | None]:
    rows = [
        *checks.runs(seen, told),
        *checks.usage(seen, told, records),
        *checks.tokens(records, tokens),
        *checks.texts(seen, told),
        *checks.greedy(seen, told),
    ]
    return {row.name: row.ok for row in rows if row.ok is not None}


def test_the_checks_pass_on_a_consistent_run(checks):
    seen, told, records, tokens, record = _world()
    verdicts = _verdicts(checks, seen, told, records, tokens)
    assert all(verdicts.values()), verdicts

    # a record whose write to Redis timed out yet landed, and went to the fallback file too:
    # the ledger's reader bills the run once
    records.files.append(record("chatcmpl-1", 7))
    assert all(_verdicts(checks, seen, told, records, tokens).values())
    records.files[-1] = record("chatcmpl-1", 8)  # but not if the two say different things
    verdicts = _verdicts(checks, seen, told, records, tokens)
    assert verdicts["runs in the stream and a fallback file (the reader counts one)"] is False


def test_the_checks_fail_on_what_breaks_a_promise(checks):
    from soak_gather import RunTold

    seen, told, records, tokens, record = _world()
    records.files.append(record("chatcmpl-2", 0))  # billed twice
    tokens.end["w"] += 1  # a token no record bills
    told["chatcmpl-1"] = RunTold(("completed", "completed"), "héllo 你")  # resumed text lost a char
    verdicts = _verdicts(checks, seen, told, records, tokens)
    assert verdicts["usage records, exactly one per run"] is False
    assert verdicts["generated tokens: ledger == workers' counters"] is False
    assert verdicts["resumed streams' text == stored text"] is False
    assert verdicts["greedy runs of one prompt say the same"] is False
    assert verdicts["other streams' text == stored text"] is True

    told["chatcmpl-2"] = RunTold(("completed", None), "héllo 你好")  # one replica lost it
    told["chatcmpl-1"] = RunTold(("cancelled", "cancelled"), "héllo")  # not what its client saw
    verdicts = _verdicts(checks, seen, told, records, tokens)
    assert verdicts["runs in one terminal state (both replicas agree)"] is False
    assert verdicts["terminal state is what its client saw"] is False
    assert verdicts["usage record's status is the run's"] is False
