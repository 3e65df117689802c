#!/usr/bin/env python3
"""What a relay's CPU costs per run and per chunk, fitted over streams of 1 and `--chunks`
chunks in the same processes, against the parsing floor's: which of the two parts a change to
the gateway moved.

It runs `gateway_overhead.py`'s processes and cells (bench/overhead_bench.py: the scripted
upstream, the floors, the gateway, any `--compare TREE` gateways, `--store`, `--retained`) and
takes its options; each repeat measures every relay at 1 chunk a stream, then at `--chunks`.
A stream of k chunks costs `run + k * chunk` CPU-ms (utime+stime of the relay from /proc), so
with c1 and ck the CPU per stream of the two cells: chunk = (ck - c1) / (k - 1), run = c1 -
chunk. Medians over the repeats, with each relay's ratio to the floor (`parsing`) and, with
`--compare`, the gateway's to each other tree's, paired within a repeat.

    .venv/bin/python bench/relay_fit.py --delays 20 --concurrency 64 --repeats 3
    .venv/bin/python bench/relay_fit.py --delays 20 --concurrency 64 --compare /tmp/before
"""

from __future__ import annotations

import statistics
import sys

from gateway_overhead import parse_args, running
from overhead_bench import Bench
from overhead_relays import compare_name

FLOOR = "parsing"


def stream_cpu_ms(bench: Bench, target: str, c: int, delay: float, chunks: int) -> float:
    """The relay's CPU-ms per stream of `chunks` chunks, over one closed-loop cell."""
    bench.args.chunks = chunks
    cell = bench.cell(target, c, delay, max(bench.args.rounds * c, bench.args.min_requests))
    return cell["cpu"] * chunks / 1000


def fit(bench: Bench, c: int, delay: float, chunks: int) -> dict[str, tuple[float, float]]:
    """(per run ms, per chunk µs) of every relay, one cell each at 1 and at `chunks`."""
    relays = [t for t in bench.targets if t != "direct"]
    one = {t: stream_cpu_ms(bench, t, c, delay, 1) for t in relays}
    many = {t: stream_cpu_ms(bench, t, c, delay, chunks) for t in relays}
    out = {}
    for t in relays:
        per_chunk = (many[t] - one[t]) / (chunks - 1)
        out[t] = (one[t] - per_chunk, per_chunk * 1000)
    return out


def table(fits: dict[tuple[float, int], list[dict]], chunks: int, compare: list[str]) -> str:
    head = (
        f"delay   C relay          | per run ms  per chunk us | / floor: run  chunk  "
        f"{chunks}-chunk stream"
    )
    lines = [head, "-" * len(head)]
    for (delay, c), runs in fits.items():
        for t in runs[0]:
            run, chunk = med(runs, lambda r, t=t: r[t][0]), med(runs, lambda r, t=t: r[t][1])
            row = f"{delay:5g} {c:3d} {t:<14} | {run:10.3f} {chunk:13.1f} |"
            if FLOOR in runs[0]:
                ratio_run = med(runs, lambda r, t=t: r[t][0] / r[FLOOR][0])
                ratio_chunk = med(runs, lambda r, t=t: r[t][1] / r[FLOOR][1])
                whole = med(runs, lambda r, t=t: stream(r[t], chunks) / stream(r[FLOOR], chunks))
                row += f" {ratio_run:12.2f} {ratio_chunk:6.2f} {whole:15.2f}"
            lines.append(row)
        for other in (compare_name(tree) for tree in compare):
            chunk = med(runs, lambda r, o=other: r["gateway"][1] / r[o][1])
            whole = med(
                runs, lambda r, o=other: stream(r["gateway"], chunks) / stream(r[o], chunks)
            )
            lines.append(
                f"{delay:5g} {c:3d} gateway / {other}: per chunk {chunk:.2f}, "
                f"a {chunks}-chunk stream {whole:.2f}"
            )
    return "\n".join(lines)


def med(runs: list[dict], fn) -> float:
    """The median of `fn` over the repeats."""
    return statistics.median(fn(r) for r in runs)


def stream(fitted: tuple[float, float], chunks: int) -> float:
    """CPU-ms of a stream of `chunks` chunks, as fitted."""
    run, chunk_us = fitted
    return run + chunks * chunk_us / 1000


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chunks = args.chunks
    if chunks < 2:
        sys.exit("--chunks must be 2 or more to fit a line")
    fits: dict[tuple[float, int], list[dict]] = {}
    try:
        with running(args) as bench:
            for rep in range(args.repeats):
                for delay in args.delays:
                    for c in args.concurrency:
                        fits.setdefault((delay, c), []).append(fit(bench, c, delay, chunks))
                print(f"  repeat {rep + 1}/{args.repeats} done", file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    print(f"CPU of each relay process, fitted over streams of 1 and {chunks} chunks")
    print(table(fits, chunks, args.compare))
    return 0


if __name__ == "__main__":
    sys.exit(main())
