"""The gateway's fair queue (policies/fair_queue.py): tier bands, weighted fair queuing over
tokens, corrections by what a run really used, and no credit banked while idle, in exact
orders; and its flow control (gateway/runs/flow_control.py) on a fake clock."""

from __future__ import annotations

from gateway.metrics import GatewayMetrics
from gateway.runs.flow_control import FlowControl
from policies.fair_queue import FairQueue, Waiting
from wire.share import Share


def waiting(key: str, tenant: str, cost: float = 100, weight: float = 1.0, tier="default"):
    return Waiting(key, tenant, weight, tier, cost)


def drain(queue: FairQueue) -> list[str]:
    out = []
    while (item := queue.pop()) is not None:
        out.append(item.key)
    return out


def test_a_flood_does_not_stand_in_front_of_a_newcomer():
    queue = FairQueue()
    for i in range(4):
        queue.push(waiting(f"noisy{i}", "noisy", cost=144))
    assert queue.pop().key == "noisy0"  # noisy alone: its first goes
    queue.push(waiting("quiet0", "quiet", cost=32))
    # quiet starts at the system's virtual time (noisy0's start) and finishes 32 later; noisy1
    # finishes 144 after noisy0 did
    assert drain(queue) == ["quiet0", "noisy1", "noisy2", "noisy3"]


def test_two_floods_take_turns_by_weight():
    queue = FairQueue()
    for i in range(7):
        queue.push(waiting(f"a{i}", "a", cost=90, weight=3.0))
        queue.push(waiting(f"b{i}", "b", cost=100, weight=1.0))
    order = drain(queue)[:8]
    # a's runs finish every 90/3 = 30 of virtual time, b's every 100: three of a's per b's one
    assert order == ["a0", "a1", "a2", "b0", "a3", "a4", "a5", "b1"]


def test_higher_tiers_go_first_whatever_the_tenant_used():
    queue = FairQueue()
    queue.push(waiting("flex", "a", tier="flex"))
    queue.push(waiting("default", "b", cost=10_000))
    queue.push(waiting("priority", "b", cost=10_000, tier="priority"))
    assert drain(queue) == ["priority", "default", "flex"]


def test_within_a_tenant_runs_keep_their_order():
    queue = FairQueue()
    for key, cost in (("first", 500), ("second", 1), ("third", 50)):
        queue.push(waiting(key, "a", cost=cost))
    assert drain(queue) == ["first", "second", "third"]


def test_what_a_run_really_used_replaces_its_estimate():
    queue = FairQueue()
    queue.push(waiting("a0", "a", cost=1000))
    assert queue.pop().key == "a0"
    queue.settle("a", 1.0, charged=1000, used=10)  # it stopped after 10 tokens
    queue.push(waiting("b0", "b", cost=100))
    queue.push(waiting("a1", "a", cost=100))
    # a is charged 10, not 1000: a1 finishes at 10 + 100 (at 1000 + 100 had a0 run to its
    # max_tokens), just after b0, which starts at the system's time (0)
    assert drain(queue) == ["b0", "a1"]
    queue.push(waiting("a2", "a", cost=100))
    queue.push(waiting("b1", "b", cost=100))
    assert drain(queue) == ["b1", "a2"]  # b finished at 100, a at 110


def test_an_idle_tenant_banks_no_credit():
    queue = FairQueue()
    for i in range(5):
        queue.push(waiting(f"busy{i}", "busy"))
    assert drain(queue) == [f"busy{i}" for i in range(5)]
    for i in range(3):
        queue.push(waiting(f"busy{5 + i}", "busy"))
        queue.push(waiting(f"back{i}", "back"))
    # back was idle through busy's five runs; it starts now, not at 0: it takes turns with busy
    # (its first ahead, as its finish is the earlier) rather than running all of its own first
    assert drain(queue) == ["back0", "busy5", "back1", "busy6", "back2", "busy7"]


def test_removing_and_shedding_pick_the_right_run():
    queue = FairQueue()
    for key, tier in (("d0", "default"), ("f0", "flex"), ("f1", "flex"), ("d1", "default")):
        queue.push(waiting(key, "a", tier=tier))
    assert (queue.queued("a"), queue.depth("a", "flex"), queue.depth("a", "default")) == (4, 2, 2)
    assert queue.newest("a", "flex").key == "f1"
    assert queue.remove("f1").key == "f1" and queue.remove("f1") is None
    assert "f1" not in queue and len(queue) == 3
    assert drain(queue) == ["d0", "d1", "f0"]


def test_a_run_that_leaves_gives_its_place_to_its_tenants_later_runs():
    queue = FairQueue()
    queue.push(waiting("a0", "a", cost=100))
    queue.push(waiting("a1", "a", cost=100))
    queue.push(waiting("b0", "b", cost=150))
    queue.remove("a0")  # cancelled while waiting: a1 now finishes at 100, not 200
    assert drain(queue) == ["a1", "b0"]


def test_settling_moves_the_tenants_waiting_runs_too():
    queue = FairQueue()
    queue.push(waiting("a0", "a", cost=1000))
    queue.push(waiting("a1", "a", cost=100))  # waits behind a0: finishes at 1100
    assert queue.pop().key == "a0"
    queue.push(waiting("b0", "b", cost=500))  # finishes at 500
    queue.settle("a", 1.0, charged=1000, used=100)  # a1 now finishes at 200
    assert drain(queue) == ["a1", "b0"]


def test_a_run_that_went_at_once_counts_for_its_tenant():
    queue = FairQueue()
    queue.went_at_once(waiting("noisy0", "noisy"))  # nothing waited: it went straight away
    queue.push(waiting("noisy1", "noisy"))
    queue.push(waiting("quiet0", "quiet"))
    assert drain(queue) == ["quiet0", "noisy1"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Backend:
    """A backend of fixed capacity, as flow control sees it."""

    def __init__(self, capacity: int) -> None:
        self.slots = capacity

    def capacity(self) -> int:
        return self.slots


async def test_flow_control_dispatches_as_capacity_frees_and_times_waits_on_its_clock():
    clock, metrics = Clock(), GatewayMetrics()
    flow = FlowControl(Backend(1), metrics, clock=clock)
    share = Share("t", 1.0, "default")
    first = flow.admit("r1", "acme", share, max_queued=4, prompt=5, cost=21)
    second = flow.admit("r2", "acme", share, max_queued=4, prompt=5, cost=21)
    assert (first.dispatched, second.dispatched, flow.in_flight) == (True, False, 1)
    clock.now += 2.5
    first.done(prompt_tokens=7, generated_tokens=3)  # its capacity goes to the waiting run
    assert second.dispatched and flow.in_flight == 1
    wait = metrics.queue_wait.labels("acme", "default")
    assert wait._sum.get() == 2.5  # 0 for the first, 2.5 s for the second
    assert metrics.tokens_served.labels("acme")._value.get() == 3
    second.done(None, 0)
    second.done(None, 0)  # idempotent
    assert flow.in_flight == 0


async def test_retry_after_is_the_queue_over_the_recent_dispatch_rate_from_1_to_60():
    clock = Clock()
    flow = FlowControl(Backend(2), GatewayMetrics(), clock=clock)
    share = Share("t", 1.0, "flex")
    assert flow.retry_after() == 60.0  # nothing dispatched lately: the longest wait
    tickets = [flow.admit(f"r{i}", "acme", share, 100, 1, 2) for i in range(22)]
    # 2 dispatched in the last 10 s (0.2/s), 20 waiting: 100 s, capped at 60
    assert flow.retry_after() == 60.0
    for ticket in tickets[:2]:
        ticket.done(None, 1)  # two more go: 4 in 10 s, 18 waiting → 45 s
    assert flow.retry_after() == 45.0
    clock.now += 11  # the window moved past all of them
    assert flow.retry_after() == 60.0
    for ticket in tickets:
        ticket.done(None, 0)
    assert (len(flow.queue), flow.in_flight) == (0, 0)
