"""Chaos: three OpenAI-compatible members of one model failing in every way under steady load.

Each cell starts three scripted upstreams (testkit/scripted_upstream.py, the deterministic text
`tok0 tok1 …`, `--delay-ms` a token) as members of one model, `chaos`, behind one fresh `sluice
serve` (`--upstream chaos=URL` three times, a JSONL usage ledger), and `--concurrency` clients of
the real `openai` SDK (no retries of its own) streaming `--tokens`-token completions back to
back. Members' own counts (`GET /_chaos/stats`: requests, tokens written, faults) are held
against the gateway's ledger and metrics.

- `faults`: every member faults `--fault-rate` of its streams at random (seeded), each fault a
  kind drawn uniformly from all of them: a refused connection, a 500, a 429 with `retry-after:
  1`, a cut after a few tokens, a stall before the first token or after a few (`--stall-seconds`,
  against the gateway's `--stall-timeout`), a malformed chunk, a body without `[DONE]`. Targets:
  no client-visible error; every run one terminal state and one usage record; the ledger's
  generated tokens equal to the members' counts. Also: every client's text equals the
  uninterrupted one, runs continued (`sluice_run_migrations_total`) against the mid-stream
  faults, retries (`sluice_retries_total`) against the faults before the stream.
- `down`: no faults; after `--lead-seconds` of load the first member goes fully down for
  `--down-seconds` (its listening socket closed, its streams in flight cut), then load goes on
  for `--tail-seconds`. Targets: upstream requests (the gateway's attempts, every member,
  continuations included) at most 1.2 times the client requests sent during the outage; the member's
  breaker open (`sluice_member_breaker_state` = 2, /metrics polled every 50 ms) within 1 s of
  the outage's start; no client-visible error.

    .venv/bin/python bench/chaos.py                  # both cells, about 3 minutes
    .venv/bin/python bench/chaos.py --quick          # a smoke run, under a minute
    .venv/bin/python bench/chaos.py --cells faults --seconds 120 --fault-rate 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import orjson
from fairness import Process
from pool_serve import ROOT
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(ROOT))  # testkit/ is not installed
from gateway.backends.local_worker import free_port
from testkit.scripted_upstream import token_text
from testkit.upstream_faults import ANSWERED, FAULT_KINDS

MODEL = "chaos"
API_KEY = "sk-sluice-bench-chaos"
MEMBERS = 3
AMPLIFICATION_TARGET = 1.2  # upstream requests / client requests during the outage, at most
BREAKER_TARGET_S = 1.0  # outage start → its breaker open, at most
POLL_S = 0.05
MID_STREAM = tuple(k for k in FAULT_KINDS if k not in ANSWERED and k != "stall_before")
VICTIM = MODEL  # the first `--upstream` of a model is named after it, the others `#2`, `#3`
BREAKER_STATES = ("closed", "half-open", "open")
MIGRATIONS, RETRIES = "sluice_run_migrations_total", "sluice_retries_total"
EJECTIONS = "sluice_member_ejections_total"

# -- the processes ------------------------------------------------------------------------------


class Member(Process):
    """One scripted upstream, a member of the pool."""

    def __init__(self, args: argparse.Namespace, cell: str, i: int, fault_rate: float) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "testkit.scripted_upstream", "--port", str(self.port),
            "--delay-ms", str(args.delay_ms), "--faults", str(fault_rate),
            "--seed", str(args.seed + i), "--stall-s", str(args.stall_seconds),
            "--fault-kinds", ",".join(args.fault_kinds),
        ]  # fmt: skip
        super().__init__(cmd, args.logdir / f"{cell}-member{i}.log")

    async def stats(self, session: aiohttp.ClientSession) -> dict:
        async with session.get(f"{self.base}/_chaos/stats") as resp:
            return await resp.json()


class Gateway(Process):
    def __init__(self, args: argparse.Namespace, cell: str, members: list[Member]) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.ledger = args.logdir / f"{cell}-usage.jsonl"
        cmd = [
            sys.executable, "-m", "gateway.cli", "serve", "--port", str(self.port),
            "--api-key", API_KEY, "--usage-file", str(self.ledger),
            "--stall-timeout", str(args.stall_timeout), "--log-level", "warning",
        ]  # fmt: skip
        for m in members:
            cmd += ["--upstream", f"{MODEL}={m.base}/v1"]
        super().__init__(cmd, args.logdir / f"{cell}-serve.log")

    async def metrics(self, session: aiohttp.ClientSession) -> dict[tuple[str, str], float]:
        """(sample, its member, reason or outcome label) → value, for the pool's samples."""
        async with session.get(f"{self.base}/metrics") as resp:
            text = await resp.text()
        out: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(text):
            if family.name.startswith(("sluice_member", "sluice_retries", "sluice_run_migr")):
                for s in family.samples:
                    label = s.labels.get("member") or s.labels.get("reason") or ""
                    label = label or s.labels.get("outcome", "")
                    out[(s.name, label)] = out.get((s.name, label), 0.0) + s.value
        return out

    async def records(self, count: int) -> list[dict]:
        """The ledger once it holds `count` records (a run is settled after its end), or what
        it holds after 20 s."""
        deadline = time.monotonic() + 20
        while True:
            lines = self.ledger.read_bytes().splitlines() if self.ledger.exists() else []
            if len(lines) >= count or time.monotonic() > deadline:
                return [orjson.loads(line) for line in lines]
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def pool(args, cell: str, session: aiohttp.ClientSession, fault_rate: float):
    members = [Member(args, cell, i, fault_rate) for i in range(MEMBERS)]
    gateway = None
    try:
        for m in members:
            await wait_answering(session, f"{m.base}/_chaos/stats", m)
        gateway = Gateway(args, cell, members)
        await wait_answering(session, f"{gateway.base}/readyz", gateway)
        yield gateway, members
    finally:
        for proc in [gateway, *members]:
            if proc is not None:
                proc.stop()


async def wait_answering(session: aiohttp.ClientSession, url: str, proc: Process) -> None:
    """Until `url` answers 200 (a process started, the gateway ready); exits if `proc` does."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.proc.poll() is not None:
            sys.exit(f"{proc.proc.args} exited:\n{proc.log.read_text(errors='replace')[-2000:]}")
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(url) as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.1)
    sys.exit(f"{url} did not answer")


# -- the load -----------------------------------------------------------------------------------


@dataclass(slots=True)
class Run:
    sent: float
    id: str | None = None
    text: str = ""
    completion: int | None = None
    error: str | None = None


async def one(client: openai.AsyncOpenAI, args: argparse.Namespace, prompt: str) -> Run:
    run = Run(sent=time.monotonic())
    try:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=args.tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            run.id = run.id or chunk.id
            for choice in chunk.choices:
                run.text += choice.delta.content or ""
            if chunk.usage is not None:
                run.completion = chunk.usage.completion_tokens
    except openai.APIError as exc:
        code = getattr(exc, "code", None) or getattr(exc, "status_code", None)
        run.error = f"{type(exc).__name__}({code})"
    return run


async def load(gateway: Gateway, args: argparse.Namespace, seconds: float) -> list[Run]:
    """`--concurrency` clients streaming back to back for `seconds`; every run, in order sent."""
    runs: list[Run] = []
    stop_at = time.monotonic() + seconds
    http = openai.DefaultAsyncHttpxClient(timeout=600)
    client = openai.AsyncOpenAI(
        base_url=f"{gateway.base}/v1", api_key=API_KEY, max_retries=0, http_client=http
    )

    async def one_client(i: int) -> None:
        j = 0
        while time.monotonic() < stop_at:
            runs.append(await one(client, args, f"chaos client {i}, request {j}"))
            j += 1

    async with client:
        await asyncio.gather(*(one_client(i) for i in range(args.concurrency)))
    return sorted(runs, key=lambda r: r.sent)


def delta(after: dict, before: dict, sample: str) -> dict[str, float]:
    return {k[1]: v - before.get(k, 0.0) for k, v in after.items() if k[0] == sample}


def listed(counts: dict, order=None) -> str:
    keys = order or sorted(counts)
    shown = [f"{k} {counts[k]:.0f}" for k in keys if counts.get(k)]
    return ", ".join(shown) or "none"


def verdict(met: bool, text: str) -> str:
    return f"{'met' if met else 'NOT MET':>7}  {text}"


# -- the cells ----------------------------------------------------------------------------------


async def faults_cell(args: argparse.Namespace, session: aiohttp.ClientSession) -> str:
    async with pool(args, "faults", session, args.fault_rate) as (gateway, members):
        runs = await load(gateway, args, args.seconds)
        records = await gateway.records(len(runs))
        metrics = await gateway.metrics(session)
        stats = [await m.stats(session) for m in members]
    return faults_report(args, runs, records, metrics, stats)


def faults_report(args, runs: list[Run], records: list[dict], metrics: dict, stats) -> str:
    whole = "".join(token_text(i) for i in range(args.tokens))
    errors = Counter(r.error for r in runs if r.error)
    per_run = Counter(rec["run_id"] for rec in records)
    streamed = {r.id for r in runs if r.id}  # a run refused before its stream has no id here
    one_each = len(records) == len(runs) and set(per_run) >= streamed
    one_each = one_each and max(per_run.values(), default=0) <= 1
    ledger_tokens = sum(rec["generated_tokens"] for rec in records)
    member_tokens = sum(s["tokens"] for s in stats)
    faults = sum((Counter(s["faults"]) for s in stats), Counter())
    retried = sum(faults[k] for k in ANSWERED)
    upstream = sum(delta(metrics, {}, "sluice_member_requests_total").values())
    intact = sum(r.text == whole for r in runs)
    counted = sum(r.completion == args.tokens for r in runs)  # both members', when continued
    rows = [
        ("client requests", f"{len(runs)}"),
        ("client-visible errors", f"{sum(errors.values())} {dict(errors) or ''}".rstrip()),
        ("runs by terminal state", listed(Counter(rec["status"] for rec in records))),
        ("usage records / runs", f"{len(records)} / {len(runs)} (one each: {one_each})"),
        ("generated tokens: ledger / members", f"{ledger_tokens} / {member_tokens}"),
        ("faults injected", f"{sum(faults.values())}: {listed(faults, FAULT_KINDS)}"),
        ("runs continued (migrations)", f"{listed(delta(metrics, {}, MIGRATIONS))} "
         f"(mid-stream faults: {sum(faults[k] for k in MID_STREAM)})"),
        ("retries", f"{listed(delta(metrics, {}, RETRIES))} (faults before it: {retried})"),
        ("upstream requests / client requests", f"{upstream / max(1, len(runs)):.3f}"),
        ("texts equal to the uninterrupted one", f"{intact} / {len(runs)}"),
        (f"clients' usage of {args.tokens} completion tokens", f"{counted} / {len(runs)}"),
    ]  # fmt: skip
    kinds = ", ".join(args.fault_kinds) if args.fault_kinds != list(FAULT_KINDS) else "all kinds"
    head = (
        f"faults: {MEMBERS} members of one model, {args.fault_rate:.0%} of each member's streams "
        f"faulted at random ({kinds}), C={args.concurrency}, "
        f"{args.seconds:.0f} s, {args.tokens} tokens a stream, stalls {args.stall_seconds:g} s "
        f"(gateway --stall-timeout {args.stall_timeout:g})"
    )
    verdicts = [
        verdict(not errors, f"0 client-visible errors while a healthy member exists: "
                f"{sum(errors.values())}"),
        verdict(one_each, f"every run one terminal state and one usage record: {len(runs)} "
                f"runs, {len(records)} records"),
        verdict(ledger_tokens == member_tokens, f"generated tokens in the ledger equal to the "
                f"members' counts: {ledger_tokens} / {member_tokens}"),
        verdict(intact == len(runs), f"every client's text is the uninterrupted text: "
                f"{intact} / {len(runs)}"),
    ]  # fmt: skip
    return "\n".join([head, *table(rows), *verdicts])


async def watch_breaker(gateway, session, member: str, since: float, into: list) -> None:
    """(seconds since `since`, state) each time `member`'s breaker state changes."""
    state = None
    while True:
        metrics = await gateway.metrics(session)
        now = metrics.get(("sluice_member_breaker_state", member))
        if now is not None and now != state:
            into.append((time.monotonic() - since, int(now)))
            state = now
        await asyncio.sleep(POLL_S)


async def down_cell(args: argparse.Namespace, session: aiohttp.ClientSession) -> str:
    async with pool(args, "down", session, 0.0) as (gateway, members):
        seconds = args.lead_seconds + args.down_seconds + args.tail_seconds
        loading = asyncio.create_task(load(gateway, args, seconds))
        await asyncio.sleep(args.lead_seconds)
        before = await gateway.metrics(session)
        began = time.monotonic()
        breaker: list[tuple[float, int]] = []
        watching = asyncio.create_task(watch_breaker(gateway, session, VICTIM, began, breaker))
        url = f"{members[0].base}/_chaos/down"
        async with session.post(url, params={"seconds": str(args.down_seconds), "how": "refuse"}):
            pass
        await asyncio.sleep(args.down_seconds - (time.monotonic() - began))
        after = await gateway.metrics(session)
        ended = time.monotonic()
        runs = await loading
        watching.cancel()
        records = await gateway.records(len(runs))
        final = await gateway.metrics(session)
    during = [r for r in runs if began <= r.sent < ended]
    return down_report(args, runs, during, records, (before, after, final), breaker)


def down_report(args, runs, during, records, metrics, breaker) -> str:
    before, after, final = metrics
    attempts = delta(after, before, "sluice_member_requests_total")
    ratio = sum(attempts.values()) / max(1, len(during))
    opened = next((t for t, state in breaker if state == 2), None)
    errors = Counter(r.error for r in runs if r.error)
    timeline = ", ".join(f"{BREAKER_STATES[s]} at {t:+.2f} s" for t, s in breaker)
    ejections = sum(v for (name, m), v in final.items() if name == EJECTIONS and m == VICTIM)
    failures = final.get(("sluice_member_failures_total", VICTIM), 0)
    rows = [
        ("client requests (whole cell / during the outage)", f"{len(runs)} / {len(during)}"),
        ("upstream requests during the outage",
         f"{sum(attempts.values()):.0f} ({listed(attempts)})"),
        ("upstream / client requests", f"{ratio:.3f}"),
        ("retries during the outage", listed(delta(after, before, RETRIES))),
        ("runs continued during the outage", listed(delta(after, before, MIGRATIONS))),
        ("breaker of the down member (from its start)", timeline or "never seen"),
        ("its failures / ejections (whole cell)", f"{failures:.0f} / {ejections:.0f}"),
        ("client-visible errors", f"{sum(errors.values())} {dict(errors) or ''}".rstrip()),
        ("usage records / runs", f"{len(records)} / {len(runs)}"),
    ]  # fmt: skip
    head = (
        f"down: member {VICTIM} of {MEMBERS} refuses connections for {args.down_seconds:g} s "
        f"(its streams cut) under C={args.concurrency}, after {args.lead_seconds:g} s of load "
        f"and before {args.tail_seconds:g} s more"
    )
    verdicts = [
        verdict(ratio <= AMPLIFICATION_TARGET, f"upstream requests <= {AMPLIFICATION_TARGET}x "
                f"client requests during the outage: {ratio:.3f}"),
        verdict(opened is not None and opened <= BREAKER_TARGET_S, f"breaker open within "
                f"{BREAKER_TARGET_S:g} s of the outage: "
                + ("never" if opened is None else f"{opened:.2f} s")),
        verdict(not errors, f"0 client-visible errors while a healthy member exists: "
                f"{sum(errors.values())}"),
    ]  # fmt: skip
    return "\n".join([head, *table(rows), *verdicts])


def table(rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(name) for name, _ in rows)
    return [f"  {name:<{width}}  {value}" for name, value in rows]


# -- main ---------------------------------------------------------------------------------------

CELLS = {"faults": faults_cell, "down": down_cell}
QUICK = {
    "seconds": 10, "concurrency": 8, "tokens": 16, "delay_ms": 10, "down_seconds": 5,
    "lead_seconds": 2, "tail_seconds": 2, "stall_seconds": 4, "stall_timeout": 2,
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cells", default="faults,down", help="comma-separated: faults, down")
    p.add_argument("--seconds", type=float, default=60, help="the faults cell's load")
    p.add_argument("--concurrency", type=int, default=12, help="streaming clients")
    p.add_argument("--tokens", type=int, default=24, help="max_tokens of each stream")
    p.add_argument("--delay-ms", type=float, default=20, help="the members' time per token")
    p.add_argument("--fault-rate", type=float, default=0.1, help="share of streams faulted")
    p.add_argument("--fault-kinds", default=",".join(FAULT_KINDS), help="the kinds drawn from")
    p.add_argument("--stall-seconds", type=float, default=30, help="how long a stall lasts")
    p.add_argument("--stall-timeout", type=float, default=10, help="the gateway's")
    p.add_argument("--down-seconds", type=float, default=30, help="the down cell's outage")
    p.add_argument("--lead-seconds", type=float, default=5, help="load before the outage")
    p.add_argument("--tail-seconds", type=float, default=5, help="load after the outage")
    p.add_argument("--seed", type=int, default=1, help="member i's faults are seeded seed + i")
    p.add_argument("--quick", action="store_true", help="a short smoke run: " + str(QUICK))
    p.add_argument("--logdir", help="keep the processes' logs here (default: a temporary folder)")
    args = p.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    args.cells = args.cells.split(",")
    args.fault_kinds = args.fault_kinds.split(",")
    if unknown := set(args.fault_kinds) - set(FAULT_KINDS):
        p.error(f"unknown fault kinds: {', '.join(sorted(unknown))}")
    if unknown := set(args.cells) - set(CELLS):
        p.error(f"unknown cells: {', '.join(sorted(unknown))}")
    return args


async def run(args: argparse.Namespace) -> None:
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for name in args.cells:
            print("\n" + await CELLS[name](args, session), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sluice-bench-chaos-") as tmp:
        args.logdir = Path(args.logdir or tmp)
        args.logdir.mkdir(parents=True, exist_ok=True)
        asyncio.run(run(args))
    print(f"\n(the whole run took {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
