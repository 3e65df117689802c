"""Two local workers behind a real `sluice serve --workers 2` on the tiny model: a member that is
killed or hung costs the clients nothing they can see (its requests go to the other member), a
killed one is restarted and routed to again, and so is one that answers nothing for
`--stall-timeout`."""

from __future__ import annotations

import contextlib
import signal

import httpx
import psutil
import pytest

from tests.e2e.test_worker_faults import chat, metric
from tests.support.serve import Served, serving
from tests.support.waiting import until_sync

# alone (tests/support/tiers.py): it times how soon killed, hung and stopped members are back
pytestmark = pytest.mark.alone


def workers(gateway: Served) -> list[psutil.Process]:
    """The gateway's live worker processes (one just killed and not yet reaped is left out)."""
    found = []
    for child in psutil.Process(gateway.proc.pid).children():
        with contextlib.suppress(psutil.ZombieProcess, psutil.NoSuchProcess):
            if "workers.cli" in child.cmdline():
                found.append(child)
    return found


def healthy_members(gateway: Served) -> float:
    return metric(gateway, "sluice_pool_member_healthy")


def test_a_killed_member_costs_no_request_and_rejoins(tiny_model_dir):
    with serving(tiny_model_dir, "--workers", "2") as gateway:
        until_sync(lambda: healthy_members(gateway) == 2, "both members to be healthy")
        before = {p.pid for p in workers(gateway)}
        victim = workers(gateway)[0]
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        answers = [chat(gateway, temperature=0) for _ in range(6)]  # greedy: no EOS drawn
        assert [a.status_code for a in answers] == [200] * 6  # none routed to the dead one
        assert all(a.json()["choices"][0]["finish_reason"] == "length" for a in answers)

        def rejoined() -> bool:
            now = {p.pid for p in workers(gateway)}
            return len(now) == 2 and now != before and healthy_members(gateway) == 2

        until_sync(rejoined, "the killed member to be restarted and routed to", within=60)
        routed = metric(gateway, "sluice_member_requests_total")
        assert [chat(gateway).status_code for _ in range(4)] == [200] * 4
        assert metric(gateway, "sluice_member_requests_total") == routed + 4


def test_a_hung_member_is_left_out_and_back_once_it_answers(tiny_model_dir):
    with serving(tiny_model_dir, "--workers", "2") as gateway:
        until_sync(lambda: healthy_members(gateway) == 2, "both members to be healthy")
        hung = workers(gateway)[1]
        hung.send_signal(signal.SIGSTOP)
        try:
            until_sync(lambda: healthy_members(gateway) == 1, "the hung member to be left out")
            answers = [chat(gateway, temperature=0) for _ in range(6)]  # greedy: no EOS drawn
            assert [a.status_code for a in answers] == [200] * 6
        finally:
            hung.send_signal(signal.SIGCONT)
        until_sync(lambda: healthy_members(gateway) == 2, "the member to be back")
        ready = httpx.get(f"{gateway.root}/readyz").json()
        assert ready["status"] == "ready"


def test_a_member_silent_for_the_stall_timeout_is_restarted(tiny_model_dir):
    with serving(tiny_model_dir, "--workers", "2", "--stall-timeout", "2") as gateway:
        until_sync(lambda: healthy_members(gateway) == 2, "both members to be healthy")
        stopped = workers(gateway)[1]
        stopped.send_signal(signal.SIGSTOP)  # no answer, no stats: no step counter to stall
        try:

            def replaced() -> bool:
                now = workers(gateway)
                return len(now) == 2 and stopped.pid not in {p.pid for p in now}

            until_sync(replaced, "the silent member to be killed and started again", within=30)
        finally:
            if stopped.is_running():
                stopped.send_signal(signal.SIGCONT)
        until_sync(lambda: healthy_members(gateway) == 2, "the restarted member back", within=60)
        assert [chat(gateway).status_code for _ in range(4)] == [200] * 4
