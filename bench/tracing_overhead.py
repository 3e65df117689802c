"""What tracing costs the gateway: CPU per streamed chunk with tracing off, and on at
`--trace-sample-ratio 1.0` exporting every run to a local OTLP/HTTP receiver, side by side in one
run (docs/tracing.md gives the figures).

Processes (bench/overhead_procs.py): the scripted OpenAI-compatible upstream, one
`sluice serve --upstream scripted=…` per setting, and the load generator (bench/loadgen.py); the
OTLP receiver (testkit/otlp_receiver.py) runs on a thread here, so its decoding is not billed to
the gateway. For each concurrency the same streamed request runs as a closed loop through each
gateway in turn, `--repeats` times interleaved; reported are the medians of the gateway process's
CPU-ms per 1,000 content chunks (utime+stime from /proc), and each setting against `off`.

    .venv/bin/python bench/tracing_overhead.py                 # about a minute
    .venv/bin/python bench/tracing_overhead.py --quick         # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from overhead_procs import ROOT, Processes, cpu_seconds, free_port

from testkit.otlp_receiver import otlp_receiver

KEY = "sk-bench-tracing"
FULL = "on, ratio 1.0"
TARGET = 0.10  # the most tracing every run may add to the gateway's CPU per chunk


def settings(endpoint: str) -> dict[str, list[str]]:
    """Each gateway's extra flags, by its name in the table."""
    return {
        "off": [],
        "on, ratio 0": ["--otlp-endpoint", endpoint, "--trace-sample-ratio", "0"],
        FULL: ["--otlp-endpoint", endpoint, "--trace-sample-ratio", "1.0"],
    }


def start(procs: Processes, endpoint: str) -> tuple[str, dict[str, tuple[int, str]]]:
    """The upstream and the gateways, ready; the upstream's URL and each gateway's (pid, URL)."""
    port = free_port()
    upstream_url = f"http://127.0.0.1:{port}/v1"
    upstream = procs.spawn("upstream", ["-m", "testkit.scripted_upstream", "--port", str(port)])
    procs.wait_ready("upstream", upstream, f"{upstream_url}/models")
    env = {**os.environ, "SLUICE_LOG_LEVEL": "warning", "OTEL_BSP_SCHEDULE_DELAY": "1000"}
    gateways = {}
    for name, flags in settings(endpoint).items():
        gw_port = free_port()
        command = ["-m", "gateway.cli", "serve", "--api-key", KEY, "--port", str(gw_port)]
        command += ["--upstream", f"scripted={upstream_url}", *flags]
        proc = procs.spawn(name.replace(" ", "").replace(",", "-"), command, env=env)
        procs.wait_ready(name, proc, f"http://127.0.0.1:{gw_port}/readyz")
        gateways[name] = (proc.pid, f"http://127.0.0.1:{gw_port}/v1/chat/completions")
    return upstream_url, gateways


def cell(loadgen: subprocess.Popen, url: str, args: argparse.Namespace, concurrency: int) -> dict:
    spec = {
        "url": url,
        "headers": {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
        "idempotency": False,
        "body": {
            "model": "scripted",
            "messages": [{"role": "user", "content": "Count."}],
            "stream": True,
            "max_tokens": args.chunks,
            "metadata": {"delay_ms": f"{args.delay_ms:g}"},
        },
        "concurrency": concurrency,
        "requests": concurrency * args.rounds,
        "min_seconds": args.min_seconds,
        "chunks": args.chunks,
        "exact_chunks": True,
    }
    loadgen.stdin.write(json.dumps(spec) + "\n")
    loadgen.stdin.flush()
    line = loadgen.stdout.readline()
    if not line:
        sys.exit("the load generator exited")
    return json.loads(line)


def measure(args: argparse.Namespace, procs: Processes, endpoint: str) -> dict:
    """CPU-ms per 1k chunks, per (gateway, concurrency), one list entry per repeat."""
    _, gateways = start(procs, endpoint)
    loadgen = procs.spawn(
        "loadgen",
        [str(ROOT / "bench" / "loadgen.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    results: dict[tuple[str, int], list[float]] = {}
    for _, url in gateways.values():  # warm-up: imports, first connections
        cell(loadgen, url, argparse.Namespace(**{**vars(args), "rounds": 1}), 4)
    for repeat in range(args.repeats):
        for concurrency in args.concurrency:
            for name, (pid, url) in gateways.items():
                before = cpu_seconds(pid)
                result = cell(loadgen, url, args, concurrency)
                spent = cpu_seconds(pid) - before
                if result["error_count"]:
                    sys.exit(f"{name}: {result['error_count']} failed streams {result['errors']}")
                per_k = spent * 1000 / (max(result["frames"], 1) / 1000)
                results.setdefault((name, concurrency), []).append(per_k)
        print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
    return results


def report(results: dict, concurrencies: list[int], spans: int) -> None:
    names = list(dict.fromkeys(name for name, _ in results))
    print(f"\nGateway CPU-ms per 1,000 streamed chunks (median over repeats); {spans} spans seen")
    print(f"{'C':>4} " + " ".join(f"{n:>16}" for n in names) + "   vs off")
    worst = 0.0
    for c in concurrencies:
        medians = {n: statistics.median(results[(n, c)]) for n in names}
        rises = {n: medians[n] / medians["off"] - 1 for n in names[1:]}
        worst = max(worst, rises[FULL])
        shown = "  ".join(f"{n}: {rise:+.1%}" for n, rise in rises.items())
        print(f"{c:>4} " + " ".join(f"{medians[n]:>16.1f}" for n in names) + f"   {shown}")
    verdict = "met" if worst <= TARGET else "NOT MET"
    print(f"tracing at ratio 1.0 adds at most {TARGET:.0%} CPU per chunk: {verdict} ({worst:+.1%})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    p.add_argument("--chunks", type=int, default=200, help="content chunks per stream")
    p.add_argument("--delay-ms", type=float, default=2.0, help="upstream delay per token")
    p.add_argument("--rounds", type=int, default=8, help="streams per cell: rounds x C")
    p.add_argument("--min-seconds", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a smoke run")
    args = p.parse_args()
    if args.quick:
        args.repeats, args.rounds, args.min_seconds, args.concurrency = 1, 2, 0.5, [4]
    with tempfile.TemporaryDirectory() as logdir, otlp_receiver() as receiver:
        procs = Processes(Path(logdir))
        try:
            results = measure(args, procs, receiver.endpoint)
        finally:
            procs.stop_all()
        report(results, args.concurrency, len(receiver.spans))


if __name__ == "__main__":
    main()
