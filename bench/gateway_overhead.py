"""What the gateway adds to a stream: TTFT, throughput, CPU per chunk and memory, against going
direct and against the floor of a minimal parsing relay, in one run.

Processes, all started and stopped here (bench/overhead_procs.py): the scripted OpenAI-compatible
upstream, the relays (bench/overhead_relays.py) and the load generator (`bench/loadgen.py`). The
relays: a bare aiohttp byte pass-through (`bench/passthrough.py`) and a minimal parsing relay on
uvloop (`bench/parsing_relay.py`, the floor: it parses each chunk as JSON and re-frames it;
`--no-baseline` leaves both out), and the gateway (`sluice serve --upstream scripted=…`) on the
in-process run store, with `--store memory,redis` on Redis too. For each delay per token and
each concurrency, the same request (model "scripted", stream, `--chunks` chunks,
`metadata.delay_ms`) goes straight to the upstream, then through each relay; the whole set is run
`--repeats` times. A cell is a closed loop of C streams: a new stream starts as soon as one ends,
until at least `--rounds` x C streams (and `--min-requests`) have run and `--min-seconds` have
passed. Reported per cell and relay, as medians over the repeats (bench/overhead_report.py):

- TTFT p50/p99, request sent → first content frame, measured by the load generator; "added" is
  relay minus direct and "over floor" relay minus parsing relay, each paired within a repeat;
- chunks/s: content chunks received per second of wall time, all streams together;
- CPU-ms per 1,000 content chunks of the relay process (utime+stime from /proc/<pid>/stat) and
  its RSS after the cell.

`--retained N` first pushes N streams through every gateway and lets them end, so each run store
holds N ended runs while the cells are measured (what a gateway that has served a while keeps).

With `--policies`, four more gateways run every cell with all tenant policies on (a tenants file
with limits high enough never to refuse; quotas, an `Idempotency-Key` per request, the usage
ledger): authenticated by API key or by an HS256 JWT, on the in-process store or on Redis.
Redis is 127.0.0.1:6379 (or `SLUICE_BENCH_REDIS_URL`, e.g. a private one whose INFO commandstats
are this run's alone), under a prefix of this run's own, removed afterwards. A second table
gives what each adds over the policies-off gateway.

    .venv/bin/python bench/gateway_overhead.py            # full run, a few minutes
    .venv/bin/python bench/gateway_overhead.py --quick    # smoke run, under 30 s
    .venv/bin/python bench/gateway_overhead.py --policies --delays 20 --concurrency 1,64
    .venv/bin/python bench/gateway_overhead.py --delays 20 --concurrency 64 \\
        --retained 10000 --store memory,redis --compare /tmp/before

With `--compare TREE` (repeatable), one more gateway runs every cell from another source tree
(another checkout of this repository, say the commit before a change: `git worktree add
/tmp/before HEAD~5`), and a last table sets them side by side: before vs after, in one run.

With `--pin`, the relays run on one half of the CPUs this process may use and everything else
(the upstream, the load generator, this script) on the other: as a gateway runs on cores of its
own in a deployment, no relay then shares a core with the load it is measured under, and a
stall of the upstream or the load generator no longer lands in its TTFT. (A Redis store runs
wherever its server does.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from overhead_bench import Bench
from overhead_procs import Processes
from overhead_relays import REDIS_URL
from overhead_report import compare_table, policies_table, safety_table, table, verdicts


def drop_redis_keys(prefix: str) -> None:
    from redis import Redis

    client = Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}*"))
    for start in range(0, len(keys), 10_000):
        client.delete(*keys[start : start + 10_000])
    client.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def listed(kind):
        return lambda text: [kind(x) for x in text.split(",") if x]

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=listed(int), default=[1, 16, 64], help="e.g. 1,16,64")
    p.add_argument("--delays", type=listed(float), default=[0.0, 20.0], help="ms per token")
    p.add_argument("--chunks", type=int, default=64, help="content chunks per stream")
    p.add_argument("--repeats", type=int, default=3, help="runs of every cell, for medians")
    p.add_argument("--rounds", type=int, default=4, help="streams per cell: rounds * C ...")
    p.add_argument("--min-requests", type=int, default=8, help="... but at least this many")
    p.add_argument("--min-seconds", type=float, default=2.0, help="... and at least this long")
    p.add_argument("--no-baseline", dest="baseline", action="store_false", help="no floors")
    p.add_argument("--quick", action="store_true", help="one short repeat: a smoke test")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--policies", action="store_true", help="add the policies-on gateways")
    p.add_argument(
        "--limits", action="store_true", help="the gateways' tenant has every limit, far above"
    )
    p.add_argument("--safety", action="store_true", help="add the safety-window gateways")
    p.add_argument("--store", type=listed(str), default=["memory"], help="memory and/or redis")
    p.add_argument("--retained", type=int, default=0, metavar="N", help="N ended runs first")
    p.add_argument(
        "--compare", metavar="TREE", action="append", default=[], help="also run its gateway"
    )
    p.add_argument(
        "--pin", action="store_true", help="relays on half the CPUs, the rest on the other half"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.rounds, args.min_requests, args.min_seconds = 1, 1, 1, 0.3
    if unknown := set(args.store) - {"memory", "redis"}:
        p.error(f"--store: unknown store {', '.join(sorted(unknown))}")
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        p.error("--pin: this process may run on one CPU only")
    return args


def report(rows: list[dict], args: argparse.Namespace) -> str:
    parts = [table(rows, args)]
    if args.policies:
        parts.append(policies_table(rows))
    if args.safety:
        parts.append(safety_table(rows))
    if args.compare:
        parts.append(compare_table(rows, args.compare))
    return "\n\n".join(parts)


@contextlib.contextmanager
def running(args: argparse.Namespace) -> Iterator[Bench]:
    """The bench's processes, started and warmed (with `--retained`, the ended runs kept), and
    stopped on the way out, its Redis keys removed, however it leaves."""
    # Ctrl-C and SIGTERM both unwind through the cleanup below, even where SIGINT was ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    redis_prefix = f"sluice-bench-{uuid.uuid4().hex[:8]}:"
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as logdir:
        procs = Processes(Path(logdir))
        try:
            started = time.monotonic()
            bench = Bench(args, procs, redis_prefix)
            print(f"  processes ready in {time.monotonic() - started:.1f} s", file=sys.stderr)
            bench.prepare()
            yield bench
        finally:
            procs.stop_all()
            if args.policies or "redis" in args.store:
                drop_redis_keys(redis_prefix)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        with running(args) as bench:
            rows = bench.run()
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps({"cells": rows, "targets": verdicts(rows)}, indent=2))
    else:
        print(report(rows, args))
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
