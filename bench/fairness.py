"""Fair sharing under contention (design §12): first come first served and fair, side by side.

Every cell runs twice on a fresh `sluice serve`: `--scheduling fcfs` (the gateway passes runs on
as they come and the worker starts them in arrival order: sluicegate before fair sharing) and
`--scheduling fair` (the default). Clients stream with temperature 0; a flood client sends its
next request as soon as its last one ended (a refused one once its `retry-after` passed), with a
`max_tokens` drawn from half to one and a half times the flood's length (so runs do not all end
together). Tokens are counted client side inside the measured window (a stream's usage, in
proportion to its chunks that arrived in the window).

- `noisy`: the default model, one worker. Tenant `noisy` keeps `--flood` streams of
  `--flood-tokens` open; tenant `quiet` sends one `--quiet-tokens` request at a time. Quiet's
  TTFT alone (before the flood) and under it, requests it finished, and the total tokens/s.
  Targets: quiet's TTFT p50 <= 250 ms and p99 <= 500 ms; fair's tokens/s >= 0.95x fcfs's.
- `weights`: tenants `heavy` (weight 3) and `light` (weight 1) flood at once (`--flood` streams
  each). Target: heavy's generated tokens / light's = 3 within 15%.
- `priority`: `noisy` floods; tenant `vip` sends one `priority` request at a time. Target: its
  TTFT within one prefill (its TTFT alone) plus two loaded engine steps (the worker's mean step
  time during the flood, `sluice_worker_step_seconds`).
- `upstream`: a scripted OpenAI-compatible upstream serving `--upstream-capacity` streams at once
  (the rest wait in its own arrival-order queue), its first token after `--upstream-ttft-ms` and
  the others `--upstream-itl-ms` apart, behind `--upstream scripted=URL#capacity=N`. Noisy floods,
  quiet sends one request at a time. Target: quiet's TTFT p50 <= 2x alone + one upstream TTFT.
- `shed`: the same upstream; tenant `bulk` (`max_queued = 16`, tiers default and flex) sends
  `--flood` flex streams and 16 default streams at once. Target: flex is shed (429) before any
  default request is refused.

Usage: `python bench/fairness.py [--cells noisy,weights,priority,upstream,shed] [--seconds 40]`
(`--model PATH` for another model; the default model is the one `make install` sets up). Logs of
each `sluice serve` go to `--logdir`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from pool_serve import ROOT, Stream, _die_with_parent, stop_process, stream_chat, user
from prometheus_client.parser import text_string_to_metric_families

from gateway.backends.local_worker import free_port
from policies.auth import hash_key

ARMS = ("fcfs", "fair")
TENANTS = {  # name → its table's extra fields
    "noisy": "",
    "quiet": "",
    "heavy": "weight = 3",
    "light": "weight = 1",
    "vip": 'tiers = ["default", "priority"]',
    "bulk": 'tiers = ["default", "flex"]\nmax_queued = 16',
}
FLOOD_PROMPT = "Write the numbers from 1 to 1000, separated by commas."
RNG = random.Random()  # flood lengths vary (seeded per arm), so runs do not all end together,
# as they would not in real traffic
QUIET_PROMPT = "What is the capital of France?"


def key(tenant: str) -> str:
    return f"sk-sluice-bench-{tenant}"


def headers(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key(tenant)}"}


def write_tenants(folder: Path) -> Path:
    path = folder / "tenants.toml"
    tables = [
        f'[tenants.{name}]\n{extra}\nkeys = ["{hash_key(key(name))}"]\n'
        for name, extra in TENANTS.items()
    ]
    path.write_text("\n".join(tables))
    return path


# -- processes ----------------------------------------------------------------------------------


class Process:
    """A child process, stopped with the bench (and killed if the bench dies)."""

    def __init__(self, cmd: list[str], log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent,
        )  # fmt: skip

    def stop(self) -> None:
        stop_process(self.proc)


class Gateway(Process):
    def __init__(self, args: argparse.Namespace, arm: str, extra: list[str], name: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "gateway.cli", "serve", "--port", str(self.port),
            "--tenants", str(args.tenants), "--scheduling", arm, "--log-level", "warning", *extra,
        ]  # fmt: skip
        super().__init__(cmd, args.logdir / f"serve-{name}-{arm}.log")

    async def ready(self, session: aiohttp.ClientSession) -> str:
        """Wait until it serves; the model id it serves."""
        deadline = time.monotonic() + 600  # a first start converts the default model
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"sluice serve exited:\n{self.log.read_text(errors='replace')[-3000:]}")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{self.base}/readyz") as resp:
                    if resp.status == 200:
                        async with session.get(
                            f"{self.base}/v1/models", headers=headers("quiet")
                        ) as models:
                            return (await models.json())["data"][0]["id"]
            await asyncio.sleep(0.3)
        sys.exit("sluice serve did not become ready")

    async def queue_wait(self, session: aiohttp.ClientSession, tenant: str) -> float:
        """The longest a run of `tenant` waited in the gateway's queues, as the histogram's
        bucket bound that holds every run of it (0 when none waited a millisecond)."""
        async with session.get(f"{self.base}/metrics") as resp:
            text = await resp.text()
        buckets = sorted(
            (float(s.labels["le"]), s.value)
            for family in text_string_to_metric_families(text)
            if family.name == "sluice_flow_queue_wait_seconds"
            for s in family.samples
            if s.name.endswith("_bucket") and s.labels.get("tenant") == tenant
        )
        total = buckets[-1][1] if buckets else 0
        first = next((bound for bound, count in buckets if count >= total), 0.0)
        return 0.0 if first == buckets[0][0] else first

    async def step_seconds(self, session: aiohttp.ClientSession) -> tuple[float, float]:
        """(seconds, steps) its local worker's engine has run so far."""
        async with session.get(f"{self.base}/metrics") as resp:
            text = await resp.text()
        members = [
            s.labels["member"]
            for f in text_string_to_metric_families(text)
            if f.name == "sluice_member_requests"
            for s in f.samples
        ]
        port = members[0].rsplit(":", 1)[1]
        async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
            text = await resp.text()
        out = {}
        for family in text_string_to_metric_families(text):
            if family.name == "sluice_worker_step_seconds":
                for s in family.samples:
                    out[s.name.rsplit("_", 1)[1]] = s.value
        return out["sum"], out["count"]


# -- clients ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Load:
    base: str
    model: str
    tenant: str
    prompt: str
    tokens: int
    tier: str | None = None
    vary: bool = False  # max_tokens drawn from [tokens / 2, tokens * 3 / 2], not fixed

    def body(self) -> dict:
        tokens = RNG.randint(self.tokens // 2, self.tokens * 3 // 2) if self.vary else self.tokens
        body = {"model": self.model, "messages": [user(self.prompt)], "max_tokens": tokens}
        return body if self.tier is None else {**body, "service_tier": self.tier}


async def keep_streaming(
    session, load: Load, until: float, out: list[Stream], pause: float = 0.0
) -> None:
    """One client: a request, then the next `pause` seconds after it ended (or, refused, once
    its `retry-after` passed, as the openai SDK waits), until `until`."""
    while time.perf_counter() < until:
        out.append(Stream(sent=0.0))
        s = await stream_chat(
            session, load.base, load.body(), out[-1], headers=headers(load.tenant)
        )
        wait = s.retry_after if s.status == 429 and s.retry_after else pause
        if wait:
            await asyncio.sleep(min(wait, max(0.0, until - time.perf_counter())))


def flood(session, load: Load, streams: int, until: float, out: list[Stream]) -> asyncio.Task:
    return asyncio.ensure_future(
        asyncio.gather(*(keep_streaming(session, load, until, out) for _ in range(streams)))
    )


async def one_at_a_time(session, load: Load, seconds: float, pause: float = 0.0) -> list[Stream]:
    out: list[Stream] = []
    await keep_streaming(session, load, time.perf_counter() + seconds, out, pause)
    return out


def in_window(streams: list[Stream], start: float, end: float) -> float:
    """Tokens generated in [start, end]: each stream's usage, in proportion to its chunks."""
    total = 0.0
    for s in streams:
        if s.chunks and s.tokens:
            inside = sum(start <= t <= end for t in s.chunks)
            total += s.tokens * inside / len(s.chunks)
    return total


def ttfts(streams: list[Stream]) -> list[float]:
    return [s.ttft for s in streams if s.ok]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def ms(value: float) -> str:
    return f"{value * 1000:,.0f}"


# -- cells --------------------------------------------------------------------------------------


async def warm(session, load: Load) -> None:
    """A few short requests: the first steps of a fresh worker are slower."""
    for _ in range(3):
        await stream_chat(
            session, load.base, {**load.body(), "max_tokens": 4}, headers=headers(load.tenant)
        )


@dataclass(slots=True)
class UnderFlood:
    """One tenant's requests, one at a time, alone and then under another's flood."""

    alone: list[float]  # TTFTs alone
    under: list[float]  # TTFTs under the flood
    tokens_per_s: float  # everyone's, in the measured window
    step_s: float | None = None  # the engine's mean step over the window (asked with `gw`)


async def under_flood(
    args, session, one: Load, noisy: Load, pause: float = 0.0, gw: Gateway | None = None
) -> UnderFlood:
    """`one` alone, then under `noisy`'s flood; with `gw`, also the local worker's mean step
    time over the measured window."""
    alone = ttfts(await one_at_a_time(session, one, args.alone_seconds))
    flooding: list[Stream] = []
    end = time.perf_counter() + args.settle + args.seconds
    task = flood(session, noisy, args.flood, end, flooding)
    await asyncio.sleep(args.settle)
    before = None if gw is None else await gw.step_seconds(session)
    start = time.perf_counter()
    ones = await one_at_a_time(session, one, end - start, pause)
    step = None
    if gw is not None and before is not None:
        after = await gw.step_seconds(session)
        step = (after[0] - before[0]) / max(1.0, after[1] - before[1])
    await task
    tokens = in_window(flooding + ones, start, end) / (end - start)
    return UnderFlood(alone, ttfts(ones), tokens, step)


async def noisy_cell(args, session, gw: Gateway, model: str) -> dict:
    quiet = Load(gw.base, model, "quiet", QUIET_PROMPT, args.quiet_tokens)
    noisy = Load(gw.base, model, "noisy", FLOOD_PROMPT, args.flood_tokens, vary=True)
    await warm(session, quiet)
    got = await under_flood(args, session, quiet, noisy)
    alone, under = got.alone, got.under
    return {
        "alone p50": pct(alone, 0.5),
        "p50": pct(under, 0.5),
        "p99": pct(under, 0.99),
        "quiet done": len(under),
        "queued at most": await gw.queue_wait(session, "quiet"),
        "tokens/s": got.tokens_per_s,
    }


async def weights_cell(args, session, gw: Gateway, model: str) -> dict:
    heavy = Load(gw.base, model, "heavy", FLOOD_PROMPT, args.flood_tokens, vary=True)
    light = Load(gw.base, model, "light", FLOOD_PROMPT, args.flood_tokens, vary=True)
    await warm(session, heavy)
    out = {"heavy": [], "light": []}
    end = time.perf_counter() + args.settle + args.seconds
    tasks = [flood(session, heavy, args.flood, end, out["heavy"])]
    tasks.append(flood(session, light, args.flood, end, out["light"]))
    await asyncio.sleep(args.settle)
    start = time.perf_counter()
    await asyncio.gather(*tasks)
    got = {name: in_window(streams, start, end) for name, streams in out.items()}
    return {
        "heavy tok/s": got["heavy"] / (end - start),
        "light tok/s": got["light"] / (end - start),
        "ratio": got["heavy"] / max(got["light"], 1e-9),
    }


async def priority_cell(args, session, gw: Gateway, model: str) -> dict:
    vip = Load(gw.base, model, "vip", QUIET_PROMPT, args.quiet_tokens, tier="priority")
    noisy = Load(gw.base, model, "noisy", FLOOD_PROMPT, args.flood_tokens, vary=True)
    await warm(session, vip)
    got = await under_flood(args, session, vip, noisy, pause=0.5, gw=gw)
    alone, under, step = got.alone, got.under, got.step_s or 0.0
    bound = pct(alone, 0.5) + 2 * step
    return {
        "alone p50": pct(alone, 0.5),
        "loaded step": step,
        "bound": bound,
        "p50": pct(under, 0.5),
        "p99": pct(under, 0.99),
        "within bound": sum(t <= bound for t in under) / max(1, len(under)),
    }


async def upstream_cell(args, session, gw: Gateway, model: str) -> dict:
    quiet = Load(gw.base, model, "quiet", QUIET_PROMPT, args.upstream_quiet_tokens)
    noisy = Load(gw.base, model, "noisy", FLOOD_PROMPT, args.upstream_flood_tokens, vary=True)
    got = await under_flood(args, session, quiet, noisy)
    alone, under = got.alone, got.under
    return {
        "alone p50": pct(alone, 0.5),
        "bound": 2 * pct(alone, 0.5) + args.upstream_ttft_ms / 1000,
        "p50": pct(under, 0.5),
        "p99": pct(under, 0.99),
        "tokens/s": got.tokens_per_s,
    }


async def shed_cell(args, session, gw: Gateway, model: str) -> dict:
    flex = Load(gw.base, model, "bulk", FLOOD_PROMPT, args.upstream_flood_tokens, tier="flex")
    default = Load(gw.base, model, "bulk", FLOOD_PROMPT, args.upstream_flood_tokens)
    out = {"flex": [], "default": []}
    end = time.perf_counter() + args.seconds / 2
    await asyncio.gather(
        flood(session, flex, args.flood, end, out["flex"]),
        flood(session, default, 16, end, out["default"]),
    )
    refused = {tier: sum(s.status == 429 for s in streams) for tier, streams in out.items()}
    served = {tier: sum(s.ok for s in streams) for tier, streams in out.items()}
    return {
        "flex served": served["flex"],
        "flex 429": refused["flex"],
        "default served": served["default"],
        "default 429": refused["default"],
        "default p50": pct(ttfts(out["default"]), 0.5),
    }


@dataclass(slots=True)
class Cell:
    run: Callable
    upstream: bool  # behind the scripted upstream (else the default model, one worker)


CELLS = {
    "noisy": Cell(noisy_cell, False),
    "weights": Cell(weights_cell, False),
    "priority": Cell(priority_cell, False),
    "upstream": Cell(upstream_cell, True),
    "shed": Cell(shed_cell, True),
}


# -- the tables ---------------------------------------------------------------------------------

SECONDS = ("alone p50", "p50", "p99", "bound", "loaded step", "default p50", "queued at most")


def table(name: str, rows: dict[str, dict]) -> str:
    columns = list(next(iter(rows.values())))
    lines = [f"\n{name}", "| arm | " + " | ".join(columns) + " |"]
    lines.append("|---" * (len(columns) + 1) + "|")
    for arm, row in rows.items():
        cells = []
        for column in columns:
            value = row[column]
            if column in SECONDS:
                cells.append(f"{ms(value)} ms")
            elif isinstance(value, float):
                cells.append(f"{value:,.2f}")
            else:
                cells.append(str(value))
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdicts(results: dict[str, dict[str, dict]]) -> list[tuple[str, str, bool]]:
    """(target, measured, met) for each cell that ran, read from the fair arm."""
    out = []
    if "noisy" in results:
        fair, fcfs = results["noisy"]["fair"], results["noisy"]["fcfs"]
        out.append(("quiet TTFT p50 <= 250 ms", f"{ms(fair['p50'])} ms", fair["p50"] <= 0.25))
        out.append(("quiet TTFT p99 <= 500 ms", f"{ms(fair['p99'])} ms", fair["p99"] <= 0.5))
        ratio = fair["tokens/s"] / fcfs["tokens/s"]
        out.append(("tokens/s fair >= 0.95x fcfs", f"{ratio:.2f}x", ratio >= 0.95))
    if "weights" in results:
        ratio = results["weights"]["fair"]["ratio"]
        out.append(("weights 3:1 within 15%", f"{ratio:.2f}:1", abs(ratio / 3 - 1) <= 0.15))
    if "priority" in results:
        fair = results["priority"]["fair"]
        met = fair["p50"] <= fair["bound"]
        out.append(("priority TTFT p50 <= prefill + 2 steps", f"{ms(fair['p50'])} ms", met))
    if "upstream" in results:
        fair = results["upstream"]["fair"]
        met = fair["p50"] <= fair["bound"]
        out.append(("upstream quiet TTFT p50 <= 2x alone + TTFT", f"{ms(fair['p50'])} ms", met))
    if "shed" in results:
        fair = results["shed"]["fair"]
        met = fair["flex 429"] > 0 and fair["default 429"] == 0
        measured = f"flex 429: {fair['flex 429']}, default 429: {fair['default 429']}"
        out.append(("flex shed before any default is refused", measured, met))
    return out


# -- main ---------------------------------------------------------------------------------------


async def run_arm(args, session, cell_name: str, arm: str) -> dict:
    cell = CELLS[cell_name]
    RNG.seed(7)  # the same lengths drawn in both arms
    upstream = None
    if cell.upstream:
        port = free_port()
        upstream = Process(
            [
                sys.executable, "-m", "testkit.scripted_upstream", "--port", str(port),
                "--delay-ms", str(args.upstream_itl_ms),
                "--first-token-ms", str(args.upstream_ttft_ms),
                "--concurrency", str(args.upstream_capacity),
            ],
            args.logdir / f"upstream-{cell_name}-{arm}.log",
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}/v1#capacity={args.upstream_capacity}"
        extra = ["--upstream", f"scripted={url}"]
    else:
        extra = ["--model", args.model, "--dtype", args.dtype] if args.model else []
    gw = Gateway(args, arm, extra, cell_name)
    try:
        model = await gw.ready(session)
        return await cell.run(args, session, gw, model)
    finally:
        gw.stop()
        if upstream is not None:
            upstream.stop()


async def main(args: argparse.Namespace) -> None:
    args.logdir.mkdir(parents=True, exist_ok=True)
    args.tenants = write_tenants(args.logdir)
    results: dict[str, dict[str, dict]] = {}
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        for name in args.cells:
            results[name] = {}
            for arm in ARMS:
                results[name][arm] = await run_arm(args, session, name, arm)
            print(table(name, results[name]), flush=True)
    print("\n| target (fair arm) | measured | met |\n|---|---|---|")
    for target, measured, met in verdicts(results):
        print(f"| {target} | {measured} | {'yes' if met else 'no'} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", default=",".join(CELLS), type=lambda v: v.split(","))
    p.add_argument("--seconds", type=float, default=40.0, help="measured seconds per arm")
    p.add_argument("--settle", type=float, default=5.0, help="flood seconds before measuring")
    p.add_argument("--alone-seconds", type=float, default=5.0)
    p.add_argument("--flood", type=int, default=48, help="streams a flooding tenant keeps open")
    p.add_argument("--flood-tokens", type=int, default=128)
    p.add_argument("--quiet-tokens", type=int, default=16)
    p.add_argument("--upstream-capacity", type=int, default=8)
    p.add_argument("--upstream-ttft-ms", type=float, default=200.0)
    p.add_argument("--upstream-itl-ms", type=float, default=20.0)
    p.add_argument("--upstream-flood-tokens", type=int, default=32)
    p.add_argument("--upstream-quiet-tokens", type=int, default=8)
    p.add_argument("--model", help="a model folder (default: the default model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--logdir", type=Path, default=Path(tempfile.gettempdir()) / "sluice-fairness")
    args = p.parse_args(argv)
    unknown = set(args.cells) - set(CELLS)
    if unknown:
        p.error(f"unknown cells {sorted(unknown)}; known: {', '.join(CELLS)}")
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
