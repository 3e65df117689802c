"""Restart backoff and crash-loop detection for local workers, on a fake clock; and the
background readiness probe that a request reads instead of asking the backend itself."""

from __future__ import annotations

import asyncio

from gateway.backend_health import BackendHealth
from gateway.supervisor import (
    CRASH_LOOP_EXITS,
    MAX_BACKOFF,
    STABLE_AFTER,
    RestartPolicy,
    exit_reason,
)
from testkit.scripted_adapter import ScriptedAdapter, text_script


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_to_its_cap_and_resets_after_a_stable_run():
    clock = Clock()
    policy = RestartPolicy(clock)
    delays = []
    for _ in range(9):
        clock.now += 1
        delays.append(policy.exited())
        policy.started()
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, MAX_BACKOFF, MAX_BACKOFF, MAX_BACKOFF]
    clock.now += STABLE_AFTER
    assert policy.exited() == 0.5  # it had stayed up: the next crash starts over


def test_a_worker_that_keeps_dying_is_crash_looping_until_it_stays_up():
    clock = Clock()
    policy = RestartPolicy(clock)
    for i in range(CRASH_LOOP_EXITS):
        assert not policy.crash_looping, i
        clock.now += 2
        policy.exited()
        policy.started()
    assert policy.crash_looping
    clock.now += STABLE_AFTER
    assert not policy.crash_looping


def test_exit_reasons_name_the_signal_or_the_code():
    assert exit_reason(-9) == "signal:SIGKILL"
    assert exit_reason(3) == "code:3"


class HangingAdapter(ScriptedAdapter):
    async def ready(self) -> bool:
        await asyncio.Event().wait()
        return True


async def test_backend_health_sees_a_backend_go_away_and_one_that_hangs():
    up = ScriptedAdapter("up", text_script(["x"]))
    hung = HangingAdapter("hung", text_script(["x"]))
    health = BackendHealth([up, hung], interval=0.01, timeout=0.05)
    await health.start()
    try:
        assert health.states() == {"scripted:up": True, "scripted:hung": False}
        up.is_ready = False
        await health.probe()
        assert not health.ready(up)
    finally:
        await health.stop()
