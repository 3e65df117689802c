"""Runs the cells of `gateway_overhead.py`: starts the upstream, the relays and the load
generator, fills the gateways' run stores (`--retained`), and measures every relay in every cell
(TTFT from the load generator; CPU and RSS of the relay process from /proc)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench_tenants import JWT_SECRET
from overhead_procs import ROOT, Processes, cpu_seconds, free_port, pin, rss_mb
from overhead_relays import FLOORS, POLICY_RELAYS, SAFETY_RELAYS, relays

FLOOR = "parsing"  # what the gateway's added TTFT is read against, when it runs


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class Bench:
    """Starts the processes; runs cells through the load generator; measures the relays."""

    def __init__(self, args: argparse.Namespace, procs: Processes, redis_prefix: str) -> None:
        self.args = args
        port = free_port()
        upstream_url = f"http://127.0.0.1:{port}/v1"
        upstream = procs.spawn("upstream", ["-m", "testkit.scripted_upstream", "--port", str(port)])
        self.relays = relays(args, upstream_url, procs.logdir, redis_prefix)
        env = {**os.environ, "SLUICE_BENCH_JWT_SECRET": JWT_SECRET}
        ports = {name: free_port() for name in self.relays}
        self.procs = {}
        for name, relay in self.relays.items():
            place = {**env, "PYTHONPATH": relay.pythonpath} if relay.pythonpath else env
            command = [*relay.command, "--port", str(ports[name])]
            self.procs[name] = procs.spawn(name, command, env=place, cwd=relay.cwd)
        self.loadgen = procs.spawn(
            "loadgen",
            [str(ROOT / "bench" / "loadgen.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.upstream_pid = upstream.pid
        if args.pin:
            pin(upstream.pid, self.loadgen.pid, list(self.procs.values()))
        procs.wait_ready("upstream", upstream, f"{upstream_url}/models")
        for name, proc in self.procs.items():
            procs.wait_ready(name, proc, f"http://127.0.0.1:{ports[name]}/healthz")
        self.targets = ["direct", *self.relays]
        self.urls = {name: f"http://127.0.0.1:{p}/v1/chat/completions" for name, p in ports.items()}
        self.urls["direct"] = f"{upstream_url}/chat/completions"

    def _spec(self, target: str, concurrency: int, delay_ms: float, requests: int) -> dict:
        relay = self.relays.get(target)
        return {
            "url": self.urls[target],
            "headers": {"Content-Type": "application/json", **(relay.headers if relay else {})},
            "idempotency": target in POLICY_RELAYS,
            "body": {
                "model": "scripted",
                "messages": [{"role": "user", "content": "Count."}],
                "stream": True,
                "max_tokens": self.args.chunks,
                "metadata": {"delay_ms": f"{delay_ms:g}"},
            },
            "concurrency": concurrency,
            "requests": requests,
            "min_seconds": self.args.min_seconds,
            "chunks": self.args.chunks,
            "exact_chunks": target not in SAFETY_RELAYS,
        }

    def _load(self, spec: dict) -> dict:
        self.loadgen.stdin.write(json.dumps(spec) + "\n")
        self.loadgen.stdin.flush()
        line = self.loadgen.stdout.readline()
        if not line:
            sys.exit("the load generator exited")
        return json.loads(line)

    def cell(self, target: str, concurrency: int, delay_ms: float, requests: int) -> dict:
        """One closed-loop run: `requests` streams, `concurrency` at a time."""
        relay = self.procs.get(target)
        pids = {"relay": relay.pid if relay else None, "upstream": self.upstream_pid}
        before = {k: cpu_seconds(pid) for k, pid in pids.items() if pid}
        result = self._load(self._spec(target, concurrency, delay_ms, requests))
        after = {k: cpu_seconds(pid) for k, pid in pids.items() if pid}
        if result["error_count"]:
            print(
                f"  {target} C={concurrency} {delay_ms:g} ms: {result['error_count']} failed "
                f"streams, e.g. {result['errors']}",
                file=sys.stderr,
            )
        frames = result["frames"]
        if target in SAFETY_RELAYS:  # per upstream chunk: the window merges what it held
            frames = len(result["ttft_s"]) * self.args.chunks
        kchunks = max(frames, 1) / 1000
        cpu_ms = {k: (after[k] - before[k]) * 1000 / kchunks for k in after}
        ttft = result["ttft_s"] or [float("nan")]
        return {
            "ttft_p50_ms": percentile(ttft, 0.50) * 1000,
            "ttft_p99_ms": percentile(ttft, 0.99) * 1000,
            "chunks_s": frames / result["wall_s"],
            "cpu": cpu_ms.get("relay", 0.0),
            "rss_mb": rss_mb(relay.pid) if relay else 0.0,
            "upstream_cpu": cpu_ms["upstream"],
            "loadgen_cpu": result["loadgen_cpu_s"] * 1000 / kchunks,
            "streams": len(result["ttft_s"]),
            "failed": result["error_count"],
        }

    def retain(self, runs: int) -> None:
        """Push `runs` streams through every gateway (not the floors, which keep nothing) and
        let them end, so each run store holds that many ended runs when measuring starts."""
        top = max(self.args.concurrency)
        for target in self.relays:
            if target in FLOORS:
                continue
            started = time.monotonic()
            spec = self._spec(target, top, 0.0, runs) | {"min_seconds": 0.0}
            result = self._load(spec)
            print(
                f"  {target}: {runs:,} runs retained in {time.monotonic() - started:.0f} s "
                f"({result['error_count']} failed), RSS {rss_mb(self.procs[target].pid):.0f} MB",
                file=sys.stderr,
            )

    def prepare(self) -> None:
        """Warm every path (the connection pools open), then retain `--retained` ended runs."""
        top = max(self.args.concurrency)
        for target in self.targets:
            self.cell(target, top, 0.0, top)
        if self.args.retained:
            self.retain(self.args.retained)

    def run(self) -> list[dict]:
        """Every cell, `--repeats` times, after `prepare`: one row of medians per cell."""
        a = self.args
        reps: dict[tuple[float, int], list[dict]] = {}
        for rep in range(a.repeats):
            for delay in a.delays:
                for c in a.concurrency:
                    requests = max(a.rounds * c, a.min_requests)
                    # NOTE: each repeat starts one target further on, so a slow spell of the
                    # shared machine does not always fall on the same target
                    turn = rep % len(self.targets)
                    order = self.targets[turn:] + self.targets[:turn]
                    run = {t: self.cell(t, c, delay, requests) for t in order}
                    run = {t: run[t] for t in self.targets}  # the tables' order
                    reps.setdefault((delay, c), []).append(run)
                    added = run["gateway"]["ttft_p99_ms"] - run["direct"]["ttft_p99_ms"]
                    print(
                        f"  repeat {rep + 1}/{a.repeats}  {delay:g} ms  C={c:<3}  gateway: added "
                        f"TTFT p99 {added:+.1f} ms, {run['gateway']['chunks_s']:,.0f} chunks/s, "
                        f"{run['gateway']['cpu']:.1f} CPU-ms/1k",
                        file=sys.stderr,
                    )
        return [summarise(delay, c, runs) for (delay, c), runs in reps.items()]


def summarise(delay: float, concurrency: int, runs: list[dict]) -> dict:
    """Medians over the repeats; added TTFT is paired with the direct run of the same repeat,
    and the gap over the floor with the floor's run of the same repeat."""

    def med(fn) -> float:
        return statistics.median(fn(r) for r in runs)

    row: dict = {"delay_ms": delay, "concurrency": concurrency}
    row["targets"] = [t for t in runs[0] if t != "direct"]
    for t in runs[0]:
        for q in ("p50", "p99"):
            row[f"{t}_{q}_ms"] = med(lambda r, t=t, q=q: r[t][f"ttft_{q}_ms"])
        row[f"{t}_chunks_s"] = med(lambda r, t=t: r[t]["chunks_s"])
        if t == "direct":
            continue
        for q in ("p50", "p99"):
            key = f"ttft_{q}_ms"
            row[f"{t}_added_{q}_ms"] = med(lambda r, t=t, k=key: r[t][k] - r["direct"][k])
            if FLOOR in runs[0]:
                over = med(lambda r, t=t, k=key: r[t][k] - r[FLOOR][k])
                row[f"{t}_over_floor_{q}_ms"] = over
        row[f"{t}_cpu"] = med(lambda r, t=t: r[t]["cpu"])
        row[f"{t}_rss_mb"] = med(lambda r, t=t: r[t]["rss_mb"])
        # the ratio targets (design: read against the floor and direct of the same repeat)
        row[f"{t}_direct_rate"] = med(lambda r, t=t: r[t]["chunks_s"] / r["direct"]["chunks_s"])
        if FLOOR in runs[0]:
            row[f"{t}_cpu_over_floor"] = med(lambda r, t=t: r[t]["cpu"] / r[FLOOR]["cpu"])
    if "gw-redis" in runs[0]:  # the Redis store against the in-process one, paired per repeat
        row["redis_cpu_ratio"] = med(lambda r: r["gw-redis"]["cpu"] / r["gateway"]["cpu"])
        row["redis_added_ttft_p50_ms"] = med(
            lambda r: r["gw-redis"]["ttft_p50_ms"] - r["gateway"]["ttft_p50_ms"]
        )
    row["upstream_cpu"] = med(lambda r: r["direct"]["upstream_cpu"])
    row["loadgen_cpu"] = med(lambda r: r["direct"]["loadgen_cpu"])
    row["failed"] = sum(r[t]["failed"] for r in runs for t in r)
    row["repeats"] = runs
    return row
