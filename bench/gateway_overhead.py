"""What the gateway adds to a stream: TTFT, throughput and CPU per chunk, against going direct.

Processes, all started and stopped here: the scripted OpenAI-compatible upstream, the gateway
(`sluice serve --upstream scripted=…`), a bare aiohttp byte pass-through (`bench/passthrough.py`,
the floor for any aiohttp relay on this machine; `--no-baseline` leaves it out) and the load
generator (`bench/loadgen.py`). For each delay per token and each concurrency, the same request
(model "scripted", stream, `--chunks` chunks, `metadata.delay_ms`) goes straight to the upstream,
then through the pass-through, then through the gateway; the whole set is run `--repeats` times.
A cell is a closed loop of C streams: a new stream starts as soon as one ends, until at least
`--rounds` x C streams (and `--min-requests`) have run and `--min-seconds` have passed. Reported
per cell, as medians over the repeats:

- added TTFT p50/p99: relay minus direct, paired within a repeat (request sent → first content
  frame, measured by the load generator);
- chunks/s: content chunks received per second of wall time, all streams together;
- CPU-ms per 1,000 content chunks of the relay process: utime+stime from /proc/<pid>/stat.

With `--policies`, four more gateways run every cell with all tenant policies on (a tenants file
with limits high enough never to refuse; quotas, an `Idempotency-Key` per request, the usage
ledger): authenticated by API key or by an HS256 JWT, on the in-process store or on Redis
(127.0.0.1:6379, a prefix of its own, removed afterwards). A second table gives what each adds
over the policies-off gateway.

    .venv/bin/python bench/gateway_overhead.py            # full run, a few minutes
    .venv/bin/python bench/gateway_overhead.py --quick    # smoke run, under 30 s
    .venv/bin/python bench/gateway_overhead.py --policies --delays 20 --concurrency 1,64

With `--compare TREE`, one more gateway runs every cell from another source tree (another
checkout of this repository, say the commit before a change: `git worktree add /tmp/before
HEAD~5`), and a last table sets the two side by side: before vs after, in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from bench_tenants import (
    API_KEY,
    JWT_SECRET,
    SAFETY_WINDOW_CHARS,
    TOKEN_CHARS,
    jwt_token,
    write_safety_tenants_file,
    write_tenants_file,
)

ROOT = Path(__file__).resolve().parent.parent
TICK_S = 1 / os.sysconf("SC_CLK_TCK")
RELAYS = ("passthrough", "gateway")
POLICY_RELAYS = ("memory+key", "memory+jwt", "redis+key", "redis+jwt")
SAFETY_RELAYS = ("window-off", "chars", "sentence")  # the same tenant, with its policy varied
REDIS_URL = "redis://127.0.0.1:6379/0"
# name: ((concurrency, delay ms), summary key, limit, "<=" or ">=")
TARGETS = {
    "gateway added TTFT p99, 64 streams x 20 ms": ((64, 20.0), "gateway_added_p99_ms", 10, "<="),
    "gateway CPU-ms per 1k chunks, 64 streams x 20 ms": ((64, 20.0), "gateway_cpu", 60, "<="),
    "gateway chunks/s, 64 streams x 0 ms": ((64, 0.0), "gateway_chunks_s", 20000, ">="),
}


# -- processes ---------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """preexec: the child gets SIGTERM if this script dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Processes:
    """The child processes. Each runs in its own session, so Ctrl-C reaches only this script,
    which then stops them in reverse order of start."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.children: list[subprocess.Popen] = []

    def spawn(self, name: str, args: list[str], **kwargs) -> subprocess.Popen:
        log = (self.logdir / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, *args],
            cwd=kwargs.pop("cwd", ROOT),
            stderr=log,
            stdout=kwargs.pop("stdout", log),
            start_new_session=True,
            preexec_fn=_die_with_parent,
            **kwargs,
        )
        self.children.append(proc)
        return proc

    def wait_ready(self, name: str, proc: subprocess.Popen, url: str) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                sys.exit(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
            time.sleep(0.05)
        sys.exit(f"{name} did not answer {url} within 30 s:\n{self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 20) -> str:
        text = (self.logdir / f"{name}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop_all(self) -> None:
        for proc in reversed(self.children):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.children):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process, from /proc (clock-tick resolution)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


# -- measuring ---------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class Bench:
    """Starts the processes; runs cells through the load generator; measures the relay's CPU."""

    def __init__(self, args: argparse.Namespace, procs: Processes) -> None:
        self.args = args
        ports = {name: free_port() for name in ("direct", *RELAYS)}
        upstream_url = f"http://127.0.0.1:{ports['direct']}/v1"
        upstream = procs.spawn(
            "upstream", ["-m", "testkit.scripted_upstream", "--port", str(ports["direct"])]
        )
        serve = ["-m", "gateway.cli", "serve", "--api-key", API_KEY]
        commands = {
            "passthrough": [str(ROOT / "bench" / "passthrough.py"), "--upstream", upstream_url],
            "gateway": [*serve, "--upstream", f"scripted={upstream_url}"],
        }
        names = RELAYS if args.baseline else ("gateway",)
        self.headers = {name: {"Authorization": f"Bearer {API_KEY}"} for name in names}
        if args.policies:
            tenants = write_tenants_file(procs.logdir)
            self.redis_prefix = f"sluice-bench-{uuid.uuid4().hex[:8]}:"
            for name in POLICY_RELAYS:
                ports[name] = free_port()
                store = ["--redis-url", REDIS_URL, "--redis-prefix", self.redis_prefix]
                commands[name] = [
                    *serve[:-2],  # no --api-key: the tenants file holds the key
                    "--tenants", str(tenants), "--upstream", f"scripted={upstream_url}",
                    "--usage-file", str(procs.logdir / f"{name}-usage.jsonl"),
                    *(store if name.startswith("redis") else []),
                ]  # fmt: skip
                token = jwt_token() if name.endswith("jwt") else API_KEY
                self.headers[name] = {"Authorization": f"Bearer {token}"}
            names = (*names, *POLICY_RELAYS)
        if args.safety:
            for name in SAFETY_RELAYS:
                ports[name] = free_port()
                tenants = write_safety_tenants_file(procs.logdir, name)
                via = ["--upstream", f"scripted={upstream_url}"]
                commands[name] = [*serve[:-2], "--tenants", str(tenants), *via]
                self.headers[name] = {"Authorization": f"Bearer {API_KEY}"}
            names = (*names, *SAFETY_RELAYS)
        env = {**os.environ, "SLUICE_BENCH_JWT_SECRET": JWT_SECRET}
        places = {name: {"env": env} for name in names}
        if args.compare:  # the same gateway command, from the other tree
            ports["before"] = free_port()
            commands["before"] = commands["gateway"]
            self.headers["before"] = self.headers["gateway"]
            tree = str(Path(args.compare).resolve())
            places["before"] = {"env": {**env, "PYTHONPATH": tree}, "cwd": tree}
            names = (*names, "before")
        self.relays = {
            name: procs.spawn(name, [*commands[name], "--port", str(ports[name])], **places[name])
            for name in names
        }
        self.loadgen = procs.spawn(
            "loadgen",
            [str(ROOT / "bench" / "loadgen.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.upstream_pid = upstream.pid
        procs.wait_ready("upstream", upstream, f"{upstream_url}/models")
        for name, proc in self.relays.items():
            procs.wait_ready(name, proc, f"http://127.0.0.1:{ports[name]}/healthz")
        self.targets = ["direct", *self.relays]
        self.urls = {t: f"http://127.0.0.1:{ports[t]}/v1/chat/completions" for t in self.targets}

    def cell(self, target: str, concurrency: int, delay_ms: float, requests: int) -> dict:
        """One closed-loop run: `requests` streams, `concurrency` at a time."""
        spec = {
            "url": self.urls[target],
            "headers": {"Content-Type": "application/json", **self.headers.get(target, {})},
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
        relay = self.relays.get(target)
        pids = {"relay": relay.pid if relay else None, "upstream": self.upstream_pid}
        before = {k: cpu_seconds(pid) for k, pid in pids.items() if pid}
        self.loadgen.stdin.write(json.dumps(spec) + "\n")
        self.loadgen.stdin.flush()
        line = self.loadgen.stdout.readline()
        after = {k: cpu_seconds(pid) for k, pid in pids.items() if pid}
        if not line:
            sys.exit("the load generator exited")
        result = json.loads(line)
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
            "upstream_cpu": cpu_ms["upstream"],
            "loadgen_cpu": result["loadgen_cpu_s"] * 1000 / kchunks,
            "streams": len(result["ttft_s"]),
            "failed": result["error_count"],
        }

    def run(self) -> list[dict]:
        a = self.args
        top = max(a.concurrency)
        for target in self.targets:  # open the connection pools, warm every path
            self.cell(target, top, 0.0, top)
        reps: dict[tuple[float, int], list[dict]] = {}
        for rep in range(a.repeats):
            for delay in a.delays:
                for c in a.concurrency:
                    requests = max(a.rounds * c, a.min_requests)
                    run = {t: self.cell(t, c, delay, requests) for t in self.targets}
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
    """Medians over the repeats; added TTFT is paired with the direct run of the same repeat."""

    def med(fn) -> float:
        return statistics.median(fn(r) for r in runs)

    row: dict = {"delay_ms": delay, "concurrency": concurrency}
    for t in runs[0]:
        for q in ("p50", "p99"):
            row[f"{t}_{q}_ms"] = med(lambda r, t=t, q=q: r[t][f"ttft_{q}_ms"])
        row[f"{t}_chunks_s"] = med(lambda r, t=t: r[t]["chunks_s"])
        if t != "direct":
            for q in ("p50", "p99"):
                key = f"ttft_{q}_ms"
                row[f"{t}_added_{q}_ms"] = med(lambda r, t=t, k=key: r[t][k] - r["direct"][k])
            row[f"{t}_cpu"] = med(lambda r, t=t: r[t]["cpu"])
    row["upstream_cpu"] = med(lambda r: r["direct"]["upstream_cpu"])
    row["loadgen_cpu"] = med(lambda r: r["direct"]["loadgen_cpu"])
    row["failed"] = sum(r[t]["failed"] for r in runs for t in r)
    row["repeats"] = runs
    return row


# -- reporting ---------------------------------------------------------------------------------


def verdicts(rows: list[dict]) -> list[dict]:
    by_cell = {(r["concurrency"], r["delay_ms"]): r for r in rows}
    out = []
    for name, (cell, key, limit, op) in TARGETS.items():
        if cell in by_cell:
            value = by_cell[cell][key]
            met = value <= limit if op == "<=" else value >= limit
            floor = by_cell[cell].get(key.replace("gateway", "passthrough"))
            out.append(
                {
                    "target": f"{name} {op} {limit:,}",
                    "value": value,
                    "met": met,
                    "passthrough": floor,
                }
            )
    return out


def table(rows: list[dict], args: argparse.Namespace) -> str:
    base = args.baseline

    def pair(row: dict, key: str, fmt: str) -> str:
        gw = format(row[f"gateway_{key}"], fmt)
        return f"{format(row[f'passthrough_{key}'], fmt)} {gw}" if base else gw

    relays = "pass   gw" if base else "gw"
    head = (
        f"{'delay':>5} {'C':>3} | TTFT p50 {'direct':>6} {'+' + relays:>12} | "
        f"TTFT p99 {'direct':>6} {'+' + relays:>12} | chunks/s {'direct':>7} {relays:>15} | "
        f"CPU-ms/1k {relays:>11}"
    )
    lines = [
        f"{args.chunks} chunks per stream; medians of {args.repeats} repeat(s). TTFT in ms, "
        "'+' = added over direct. CPU-ms per 1,000 content chunks, of the relay process. "
        + ("pass = bare aiohttp byte pass-through, gw = gateway." if base else "gw = gateway."),
        head,
        "-" * len(head),
    ]
    for r in rows:
        lines.append(
            f"{r['delay_ms']:>5g} {r['concurrency']:>3} | "
            f"{'':8} {r['direct_p50_ms']:>6.1f} {pair(r, 'added_p50_ms', '+6.1f'):>12} | "
            f"{'':8} {r['direct_p99_ms']:>6.1f} {pair(r, 'added_p99_ms', '+6.1f'):>12} | "
            f"{'':8} {r['direct_chunks_s']:>7,.0f} {pair(r, 'chunks_s', '7,.0f'):>15} | "
            f"{'':9} {pair(r, 'cpu', '5.1f'):>11}"
        )
    for v in verdicts(rows):
        floor = "" if v["passthrough"] is None else f"  (pass-through: {v['passthrough']:,.1f})"
        status = "met" if v["met"] else "NOT MET"
        lines.append(f"{status:>7}  {v['target']}: {v['value']:,.1f}{floor}")
    return "\n".join(lines)


def compare_table(rows: list[dict]) -> str:
    """The gateway of this tree ("after") against the one of `--compare` ("before")."""
    head = (
        f"{'delay':>5} {'C':>3} | added TTFT p50 before  after | p99 before  after | "
        f"chunks/s  before   after ratio | CPU-ms/1k before after ratio"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        cb, ca = r["before_cpu"], r["gateway_cpu"]
        sb, sa = r["before_chunks_s"], r["gateway_chunks_s"]
        lines.append(
            f"{r['delay_ms']:>5g} {r['concurrency']:>3} | "
            f"{'':14} {r['before_added_p50_ms']:>+6.1f} {r['gateway_added_p50_ms']:>+6.1f} | "
            f"{'':3} {r['before_added_p99_ms']:>+6.1f} {r['gateway_added_p99_ms']:>+6.1f} | "
            f"{'':8} {sb:>7,.0f} {sa:>7,.0f} {sa / sb:>5.2f} | "
            f"{'':9} {cb:>6.1f} {ca:>5.1f} {ca / cb:>5.2f}"
        )
    return "\n".join(lines)


def safety_table(rows: list[dict]) -> str:
    """What the safety window adds over the same tenant without one, cell by cell: TTFT (and
    the hold the window itself implies: W characters at the stream's rate) and CPU per chunk."""
    head = (
        f"{'delay':>5} {'C':>3} {'window':<9} | added TTFT p50 {'p99':>7} | own hold {'+5ms':>6} "
        f"{'ok':>3} | CPU-ms/1k {'off':>6} {'this':>6} {'ratio':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        for name in SAFETY_RELAYS[1:]:
            if f"{name}_cpu" not in r:
                continue
            p50 = r[f"{name}_added_p50_ms"] - r["window-off_added_p50_ms"]
            p99 = r[f"{name}_added_p99_ms"] - r["window-off_added_p99_ms"]
            hold = SAFETY_WINDOW_CHARS / TOKEN_CHARS * r["delay_ms"]
            off, this = r["window-off_cpu"], r[f"{name}_cpu"]
            ok = "yes" if p99 <= hold + 5 else "NO"
            lines.append(
                f"{r['delay_ms']:>5g} {r['concurrency']:>3} {name:<9} | {p50:>+14.1f} {p99:>+7.1f}"
                f" | {hold:>8.1f} {hold + 5:>6.1f} {ok:>3} | {off:>16.1f} {this:>6.1f} "
                f"{this / off:>6.2f}"
            )
    return "\n".join(lines)


def policies_table(rows: list[dict]) -> str:
    """What each policies-on gateway adds over the policies-off one, cell by cell."""
    head = (
        f"{'delay':>5} {'C':>3} {'policies on':<12} | added over gw: TTFT p50 {'p99':>7} | "
        f"CPU-ms/1k {'gw':>6} {'this':>6} {'ratio':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        for name in POLICY_RELAYS:
            if f"{name}_cpu" not in r:
                continue
            p50 = r[f"{name}_added_p50_ms"] - r["gateway_added_p50_ms"]
            p99 = r[f"{name}_added_p99_ms"] - r["gateway_added_p99_ms"]
            gw, this = r["gateway_cpu"], r[f"{name}_cpu"]
            lines.append(
                f"{r['delay_ms']:>5g} {r['concurrency']:>3} {name:<12} | "
                f"{p50:>+23.1f} {p99:>+7.1f} | {gw:>16.1f} {this:>6.1f} {this / gw:>6.2f}"
            )
    return "\n".join(lines)


def drop_redis_keys(prefix: str) -> None:
    from redis import Redis

    client = Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{prefix}*"))
    if keys:
        client.delete(*keys)
    client.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def numbers(kind):
        return lambda text: [kind(x) for x in text.split(",") if x]

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=numbers(int), default=[1, 16, 64], help="e.g. 1,16,64")
    p.add_argument("--delays", type=numbers(float), default=[0.0, 20.0], help="ms per token")
    p.add_argument("--chunks", type=int, default=64, help="content chunks per stream")
    p.add_argument("--repeats", type=int, default=3, help="runs of every cell, for medians")
    p.add_argument("--rounds", type=int, default=4, help="streams per cell: rounds * C ...")
    p.add_argument("--min-requests", type=int, default=8, help="... but at least this many")
    p.add_argument("--min-seconds", type=float, default=2.0, help="... and at least this long")
    p.add_argument("--no-baseline", dest="baseline", action="store_false", help="no pass-through")
    p.add_argument("--quick", action="store_true", help="one short repeat: a smoke test")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--policies", action="store_true", help="add the policies-on gateways")
    p.add_argument("--safety", action="store_true", help="add the safety-window gateways")
    p.add_argument("--compare", metavar="TREE", help="also run the gateway of this source tree")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.rounds, args.min_requests, args.min_seconds = 1, 1, 1, 0.3
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Ctrl-C and SIGTERM both unwind through the cleanup below, even where SIGINT was ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as logdir:
        procs = Processes(Path(logdir))
        try:
            started = time.monotonic()
            bench = Bench(args, procs)
            print(f"  processes ready in {time.monotonic() - started:.1f} s", file=sys.stderr)
            rows = bench.run()
        except KeyboardInterrupt:
            return 130
        finally:
            procs.stop_all()
            if args.policies and "bench" in locals():
                drop_redis_keys(bench.redis_prefix)
    if args.json:
        print(json.dumps({"cells": rows, "targets": verdicts(rows)}, indent=2))
    else:
        print(table(rows, args))
        if args.policies:
            print("\n" + policies_table(rows))
        if args.safety:
            print("\n" + safety_table(rows))
        if args.compare:
            print("\n" + compare_table(rows))
    return 1 if any(r["failed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
