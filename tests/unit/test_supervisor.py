"""Restart backoff and crash-loop detection for local workers, on a fake clock; and the
background readiness probe that a request reads instead of asking the backend itself."""

from __future__ import annotations

import asyncio

from gateway.backends.health import BackendHealth
from gateway.backends.supervisor import (
    CRASH_LOOP_EXITS,
    MAX_BACKOFF,
    STABLE_AFTER,
    RestartPolicy,
    Supervisor,
    exit_reason,
)
from gateway.metrics import GatewayMetrics
from testkit.scripted_adapter import ScriptedAdapter, text_script
from tests.support.waiting import until


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


def test_starts_that_never_come_up_back_off_and_are_a_crash_loop():
    """A worker up for an hour dies, and each restart then waits its whole start timeout for a
    worker that never serves: the failed starts double the backoff as crashes do."""
    clock = Clock()
    policy = RestartPolicy(clock)
    clock.now += 3600
    delays = []
    for _ in range(8):
        delays.append(policy.exited())
        clock.now += delays[-1] + 300  # the wait, then a start that times out
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, MAX_BACKOFF, MAX_BACKOFF]
    assert policy.crash_looping
    policy.started()  # it comes up at last
    assert policy.crash_looping
    clock.now += STABLE_AFTER
    assert not policy.crash_looping
    assert policy.exited() == 0.5


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


class NeverUpWorker:
    """A local worker that is killed once, then fails `failures` starts (a start that times out,
    then one whose process cannot be created, in turn) before one comes up."""

    name = "local:1"
    url = "http://127.0.0.1:1"

    def __init__(self, clock: Clock, failures: int) -> None:
        self.clock = clock
        self.failures = failures
        self.starts = 0
        self.up = asyncio.Event()
        self.exits = [-9]  # the return codes `wait` gives, then it waits forever

    async def wait(self) -> int:
        if self.exits:
            return self.exits.pop(0)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def start(self, ready_within: float) -> None:
        self.starts += 1
        if self.starts > self.failures:
            self.up.set()
            return
        if self.starts % 2:
            self.clock.now += ready_within
            raise RuntimeError(f"worker not ready after {ready_within:.0f} s")
        raise OSError(12, "Cannot allocate memory")

    async def stop(self) -> None:
        return None


async def test_the_supervisor_restarts_a_worker_that_never_comes_up_with_backoff():
    clock = Clock()
    worker = NeverUpWorker(clock, failures=7)
    metrics = GatewayMetrics()
    delays: list[float] = []

    async def sleep(seconds: float) -> None:
        delays.append(seconds)
        clock.now += seconds

    supervisor = Supervisor([worker], metrics, 300.0, clock=clock, sleep=sleep)  # type: ignore[list-item]
    exited: list[str] = []
    restarted: list[str] = []
    supervisor.exit_listeners.append(exited.append)
    supervisor.restart_listeners.append(restarted.append)
    supervisor.start()
    try:
        await asyncio.wait_for(worker.up.wait(), 10)
        await until(lambda: restarted, "the restart to be told")
        assert exited == [worker.name]  # the process exit, told once; failed starts are not exits
        assert restarted == [worker.name]  # once it serves; failed starts are not restarts
        sample = metrics.registry.get_sample_value
        member = {"member": worker.name}
        assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, MAX_BACKOFF, MAX_BACKOFF]
        assert worker.starts == 8
        assert sample("sluice_local_worker_restarts_total", member) == 8
        assert (
            sample("sluice_local_worker_exits_total", {**member, "reason": "signal:SIGKILL"}) == 1
        )
        assert sample("sluice_local_worker_exits_total", {**member, "reason": "start_failed"}) == 7
        assert sample("sluice_local_worker_crash_looping", member) == 1  # up, but not for long
        assert supervisor.crash_looping(worker.name) is True  # not worth waiting for
        clock.now += STABLE_AFTER
        assert sample("sluice_local_worker_crash_looping", member) == 0
        assert supervisor.crash_looping(worker.name) is False
        assert supervisor.crash_looping("local:2") is False  # not one of its workers
    finally:
        await supervisor.stop()
