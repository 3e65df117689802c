"""What handing a chunk from a run's driver to its stream costs, apart from the network: the
ceiling of what a driver writing straight to its caught-up followers could save.

One process, one event loop, no sockets. A producer appends one event at a time to each of
`--runs` runs; one follower per run reads it. Rows, in turns over `--repeats`:

- `log`: the gateway's path, `MemoryRunStore.append` → the waiting follower's future →
  `RunManager.follow` (wait, then read) → the follower's loop;
- `queue`: the least a hand-off between two tasks costs, an `asyncio.Queue` per follower;
- `direct`: no hand-off, the producer calls the follower's code itself (what a driver writing
  to its followers would do), as the floor.

CPU µs per event delivered, and each row against `log`. Compare the `log` row with the gateway's
CPU per chunk in `gateway_overhead.py` (the same host): the difference between `log` and
`direct` is all a direct hand-off could take off it.

    .venv/bin/python bench/follow_handoff.py --runs 64 --events 200 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.runs.manager import RunManager
from gateway.runs.status import RunStatus
from gateway.state.run_store import RunRecord, TerminalRecord, log_chunk
from gateway.state.run_store_memory import MemoryRunStore

PAYLOAD = (
    b'{"id":"chatcmpl-0","object":"chat.completion.chunk","created":0,"model":"m",'
    b'"choices":[{"index":0,"delta":{"content":"hello"},"finish_reason":null}]}'
)
ENDED = TerminalRecord(RunStatus.COMPLETED, "completed", "stop")


async def through_the_log(runs: int, events: int) -> int:
    store = MemoryRunStore()
    manager = RunManager(store)
    delivered = 0

    async def follow(run_id: str) -> None:
        nonlocal delivered
        async for batch in manager.follow(run_id, 0, 512):
            delivered += len(batch)

    ids = [f"run-{i}" for i in range(runs)]
    for run_id in ids:
        await store.create(RunRecord(run_id, tenant="t", model="m", created=0.0))
    followers = [asyncio.create_task(follow(run_id)) for run_id in ids]
    await asyncio.sleep(0)
    for _ in range(events):
        for run_id in ids:
            await store.append(run_id, [log_chunk(PAYLOAD, "hello", 0)])
        await asyncio.sleep(0)  # a loop turn between chunks, as upstream reads give
    for run_id in ids:
        await store.finish(run_id, ENDED)
    await asyncio.gather(*followers)
    return delivered


async def through_a_queue(runs: int, events: int) -> int:
    delivered = 0
    queues: list[asyncio.Queue[bytes | None]] = [asyncio.Queue() for _ in range(runs)]

    async def follow(queue: asyncio.Queue[bytes | None]) -> None:
        nonlocal delivered
        while await queue.get() is not None:
            delivered += 1

    followers = [asyncio.create_task(follow(q)) for q in queues]
    await asyncio.sleep(0)
    for seq in range(events):
        for queue in queues:
            queue.put_nowait(b"%d" % seq + PAYLOAD)
        await asyncio.sleep(0)
    for queue in queues:
        queue.put_nowait(None)
    await asyncio.gather(*followers)
    return delivered


async def directly(runs: int, events: int) -> int:
    delivered = 0
    logs: list[list[tuple]] = [[] for _ in range(runs)]

    def follower(log: list[tuple], event: tuple) -> None:
        nonlocal delivered
        log.append(event)  # what the driver would hand the stream's writer
        delivered += 1

    for seq in range(events):
        for log in logs:
            follower(log, (seq, PAYLOAD, "hello", 0))
        await asyncio.sleep(0)
    return delivered


ROWS: dict[str, Callable[[int, int], Awaitable[int]]] = {
    "log": through_the_log,
    "queue": through_a_queue,
    "direct": directly,
}


def measure(row: str, runs: int, events: int) -> float:
    started = time.process_time()
    delivered = asyncio.run(ROWS[row](runs, events))
    assert delivered == runs * events, f"{row}: {delivered} of {runs * events} delivered"
    return (time.process_time() - started) / delivered * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=64)
    p.add_argument("--events", type=int, default=200, help="events per run")
    p.add_argument("--repeats", type=int, default=5, help="rounds of all rows, for medians")
    args = p.parse_args(argv)
    times: dict[str, list[float]] = {row: [] for row in ROWS}
    for _ in range(args.repeats):
        for row in ROWS:  # NOTE: rows take turns, so a slow spell falls on all of them
            times[row].append(measure(row, args.runs, args.events))
    log = statistics.median(times["log"])
    print(f"{args.runs} runs x {args.events} events, medians of {args.repeats}; CPU us per event")
    print(f"{'row':<8} {'us/event':>9} {'vs log':>7}")
    for row, values in times.items():
        us = statistics.median(values)
        print(f"{row:<8} {us:>9.2f} {us / log:>6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
