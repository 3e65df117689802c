"""How well cancellation stops the work: tail tokens, cancel latency and outcome, per source.

Starts `sluice serve` on a real worker (`--model`, the default SmolLM2 unless told otherwise;
`--model tiny` builds the tiny test model) with `--disconnect-grace 0`, keeps `--concurrency`
streams going, and cancels each one after a random number of content chunks: half by
`POST /v1/chat/completions/{id}/cancel` while still reading (source `client`), half by hanging
up (source `disconnect`, the zero grace window turns it into a cancel at once). Every run's
numbers come from the gateway's own "run end" log line:

- tail tokens: tokens that reached the gateway after the cancel decision (never sent), and the
  worker's own count of tokens generated after the abort arrived there;
- cancel latency: decision → the worker confirmed the stop (its stream ended after the abort),
  split into the worker's part (abort arrival → the step boundary where it stopped the sequence,
  which it reports; bounded by the step in flight) and the gateway's part (the rest: the abort
  call, the confirmation's way back);
- outcome: clean (no tail), tail, unconfirmed (the worker never confirmed).

Targets: every cancel confirmed, p99 tail ≤ 1 token per sequence, p99 cancel latency ≤ one
engine step + 20 ms (the mean of `sluice_worker_step_seconds` over the run is shown; a prefill
step under load is longer than the mean, which is why the gateway's part is shown apart).

    .venv/bin/python bench/cancel.py                      # default model, 64 streams
    .venv/bin/python bench/cancel.py --model tiny --streams 200 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "sk-sluice-bench-cancel"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = [
    "Write a long story about a lighthouse keeper.",
    "Explain how a compiler works, step by step, in detail.",
    "List everything you know about the history of tea.",
    "Describe a walk through a busy market in the morning.",
]


@dataclass
class Args:
    model: str
    streams: int
    concurrency: int
    max_tokens: int
    max_cut: int
    seed: int
    port: int
    dtype: str


def parse_args() -> Args:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default", help="'default', 'tiny', or a local HF folder")
    p.add_argument("--streams", type=int, default=64, help="streams started (all cancelled)")
    p.add_argument("--concurrency", type=int, default=16, help="streams live at once (the load)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--max-cut", type=int, default=48, help="cancel after 1..N content chunks")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--port", type=int, default=8791)
    p.add_argument("--dtype", default="auto")
    return Args(**vars(p.parse_args()))


def model_path(name: str) -> str:
    if name != "tiny":
        return name
    if str(ROOT) not in sys.path:  # testkit/ is not installed
        sys.path.insert(0, str(ROOT))
    from testkit.tiny_model import build_tiny_model

    return str(build_tiny_model(Path(tempfile.mkdtemp(prefix="sluice-tiny-"))))


def start_gateway(args: Args, log_path: Path) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "gateway.cli", "serve",
        "--model", model_path(args.model), "--dtype", args.dtype, "--device", "auto",
        "--api-key", API_KEY, "--port", str(args.port), "--disconnect-grace", "0",
    ]  # fmt: skip
    env = {**os.environ, "SLUICE_LOG_LEVEL": "info"}
    out = log_path.open("wb")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)


async def wait_ready(base: str, proc: subprocess.Popen) -> str:
    deadline = time.monotonic() + 600  # the first start converts the default model
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit("sluice serve exited during start-up")
            try:
                async with session.get(f"{base}/readyz") as resp:
                    if resp.status == 200:
                        async with session.get(f"{base}/v1/models", headers=HEADERS) as models:
                            return (await models.json())["data"][0]["id"]
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.3)
    raise SystemExit("sluice serve did not become ready")


async def one_stream(session: aiohttp.ClientSession, base: str, model: str, i: int,
                     rng: random.Random, args: Args) -> str:  # fmt: skip
    """Start a stream, read 1..max_cut content chunks, then cancel it by its source."""
    source = "client" if i % 2 == 0 else "disconnect"
    cut = rng.randint(1, args.max_cut)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
    }
    resp = await session.post(f"{base}/v1/chat/completions", json=body, headers=HEADERS)
    run_id, seen = None, 0
    try:
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            run_id = run_id or chunk.get("id")
            if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                seen += 1
            if seen >= cut:
                break
        if source == "client" and run_id:
            cancel = f"{base}/v1/chat/completions/{run_id}/cancel"
            async with session.post(cancel, headers=HEADERS) as answer:
                await answer.read()
            await resp.read()  # the stream ends with the `cancelled` error frame
    finally:
        resp.close()  # for `disconnect`: the hang-up is the cancel
    return source


def worker_step_seconds(metrics_text: str) -> float:
    total = count = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "sluice_worker_step_seconds":
            for s in family.samples:
                if s.name.endswith("_sum"):
                    total = s.value
                elif s.name.endswith("_count"):
                    count = s.value
    return total / count if count else float("nan")


def local_worker_port(metrics_text: str) -> str:
    """The port of the gateway's local worker, from its pool member's name (`local:PORT`)."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "sluice_member_requests":
            for s in family.samples:
                if s.labels["member"].startswith("local:"):
                    return s.labels["member"].rsplit(":", 1)[1]
    raise RuntimeError("the gateway names no local worker")


async def drive(args: Args, base: str, model: str) -> float:
    rng = random.Random(args.seed)
    gate = asyncio.Semaphore(args.concurrency)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        # warm-up: one short stream, not counted
        async with session.post(
            f"{base}/v1/chat/completions",
            json={
                "model": model,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 8,
                "stream": True,
            },
            headers=HEADERS,
        ) as warm:
            await warm.read()

        async def bounded(i: int) -> None:
            async with gate:
                await one_stream(session, base, model, i, rng, args)

        began = time.monotonic()
        await asyncio.gather(*(bounded(i) for i in range(args.streams)))
        wall = time.monotonic() - began
        await asyncio.sleep(1.0)  # let the last confirmations land
        async with session.get(f"{base}/metrics") as resp:
            port = local_worker_port(await resp.text())
        async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
            step = worker_step_seconds(await resp.text())
    print(f"{args.streams} streams in {wall:.1f} s at concurrency {args.concurrency}")
    return step


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def report(runs: list[dict], finished: int, step_s: float) -> None:
    target_ms = step_s * 1000 + 20
    print(f"\nengine step (mean) {step_s * 1000:.1f} ms → latency target p99 ≤ {target_ms:.1f} ms")
    head = (
        f"{'source':<11}{'runs':>5}{'confirmed':>10}{'clean':>7} | tail tokens p50 {'p99':>4} "
        f"{'max':>4} (worker p99) | latency ms p50 {'p99':>7} {'p99/target':>10} | "
        f"worker part p99 | gateway part p50 {'p99':>6}"
    )
    print(head)
    print("-" * len(head))
    for source in ("client", "disconnect", "all"):
        rows = [r for r in runs if source == "all" or r["cancel_source"] == source]
        if not rows:
            continue
        confirmed = [r for r in rows if r["cancel_outcome"] != "unconfirmed"]
        tails = [r["tail_tokens"] for r in rows]
        worker_tails = [r.get("upstream_tail_tokens") or 0 for r in rows]
        latency = [r["cancel_latency_ms"] for r in confirmed if r["cancel_latency_ms"] is not None]
        worker_part = [r.get("upstream_stop_ms") or 0.0 for r in confirmed]
        gateway_part = [
            r["cancel_latency_ms"] - (r.get("upstream_stop_ms") or 0.0)
            for r in confirmed
            if r["cancel_latency_ms"] is not None
        ]
        clean = sum(r["cancel_outcome"] == "clean" for r in rows)
        p99 = pct(latency, 99)
        print(
            f"{source:<11}{len(rows):>5}{len(confirmed) / len(rows):>10.0%}"
            f"{clean / len(rows):>7.0%} | {pct(tails, 50):>15.0f} {pct(tails, 99):>4.0f} "
            f"{max(tails):>4} {pct(worker_tails, 99):>12.0f} | {pct(latency, 50):>14.1f} "
            f"{p99:>7.1f} {p99 / target_ms:>10.2f} | {pct(worker_part, 99):>15.1f} | "
            f"{pct(gateway_part, 50):>16.1f} {pct(gateway_part, 99):>6.1f}"
        )
    if finished:
        print(f"({finished} runs ended on their own before their cancel landed)")


def run_end_lines(log_path: Path) -> list[dict]:
    runs = []
    for line in log_path.read_text(errors="replace").splitlines():
        if '"run end"' not in line:
            continue
        with_json = line[line.index("{") :]
        record = json.loads(with_json)
        if record.get("cancel_source") or record.get("status") == "completed":
            runs.append(record)
    return runs


def main() -> None:
    args = parse_args()
    log_path = Path(tempfile.mkdtemp(prefix="sluice-bench-")) / "gateway.log"
    base = f"http://127.0.0.1:{args.port}"
    proc = start_gateway(args, log_path)
    try:
        model = asyncio.run(wait_ready(base, proc))
        cut = f"cancel after 1..{args.max_cut} chunks"
        print(f"model {model} | {args.max_tokens} max tokens | {cut}")
        step = asyncio.run(drive(args, base, model))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    runs = run_end_lines(log_path)
    cancelled = [r for r in runs if r.get("cancel_source")]
    finished = len(runs) - len(cancelled) - 1  # the warm-up run completes too
    report(cancelled, finished, step)


if __name__ == "__main__":
    main()
