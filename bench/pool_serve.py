"""The processes and the client of `bench/pool.py`: one `sluice serve` with N local workers, and
one streaming chat completion read frame by frame.

`Serve` starts the gateway with `--workers N --pool-routing R`, waits until every member is
listed, optionally pins each worker process (every thread of it) to cores of its own, and reads
the members' own `/v1/stats` and the gateway's pool metrics. `other_cpu` tells how much of the
machine something else used meanwhile, since rows run one after another on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "sk-sluice-bench-pool"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}

# -- one streaming request ----------------------------------------------------------------------


@dataclass(slots=True)
class Stream:
    sent: float
    status: int = 0
    chunks: list[float] = field(default_factory=list)  # arrival of each content chunk
    text: str = ""
    tokens: int = 0  # completion tokens, from the usage chunk
    prompt: int = 0  # prompt tokens, from the usage chunk
    error: str | None = None
    ended: float = 0.0
    turn: int = 0  # of its conversation, for the caller
    retry_after: float | None = None  # a refusal's `retry-after`, in seconds

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and bool(self.chunks)

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]


async def stream_chat(
    session: aiohttp.ClientSession,
    base: str,
    body: dict,
    s: Stream | None = None,
    answered: asyncio.Event | None = None,
    headers: dict[str, str] | None = None,
) -> Stream:
    """One streaming chat completion, read frame by frame into `s` (which others may watch
    while it fills); an error frame is recorded. `answered` is set when the headers came;
    `headers` authenticate it (the bench's own key by default)."""
    answered = answered or asyncio.Event()
    body = {**body, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
    s = s or Stream(sent=0.0)
    s.sent = time.perf_counter()
    try:
        url = f"{base}/v1/chat/completions"
        async with session.post(url, json=body, headers=headers or HEADERS) as resp:
            s.status = resp.status
            answered.set()
            if "retry-after" in resp.headers:
                s.retry_after = float(resp.headers["retry-after"])
            if resp.status != 200:
                s.error = f"status {resp.status}"
                await resp.read()
                return s
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                frame = json.loads(line[6:])
                if "error" in frame:
                    s.error = frame["error"].get("code") or "error frame"
                    continue
                for choice in frame.get("choices") or ():
                    if delta := choice["delta"].get("content"):
                        s.chunks.append(time.perf_counter())
                        s.text += delta
                if frame.get("usage"):
                    s.tokens = frame["usage"]["completion_tokens"]
                    s.prompt = frame["usage"]["prompt_tokens"]
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        s.error = type(exc).__name__
    finally:
        s.ended = time.perf_counter()
        answered.set()
    return s


# -- sluice serve -------------------------------------------------------------------------------


def _die_with_parent() -> None:
    """preexec: the child gets SIGTERM if this script dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Serve:
    """One `sluice serve` with N local workers, started fresh for one row and stopped after."""

    def __init__(
        self, args: argparse.Namespace, name: str, workers: int, routing: str, logdir: Path
    ):
        self.args, self.workers, self.max_tokens = args, workers, args.max_tokens
        self.base = f"http://127.0.0.1:{args.port}"
        cmd = [
            sys.executable, "-m", "gateway.cli", "serve", "--model", args.model_path,
            "--dtype", args.dtype, "--workers", str(workers), "--pool-routing", routing,
            "--api-key", API_KEY, "--port", str(args.port),
        ]  # fmt: skip
        threads = str(args.worker_threads)
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        self.log = logdir / f"serve-{name}.log"
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent,
        )  # fmt: skip

    async def start(self, session: aiohttp.ClientSession) -> None:
        deadline = time.monotonic() + 600  # the first start converts the default model
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"sluice serve exited:\n{self.log.read_text(errors='replace')[-3000:]}")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{self.base}/readyz") as resp:
                    if resp.status == 200 and len(await self.members(session)) == self.workers:
                        async with session.get(f"{self.base}/v1/models", headers=HEADERS) as m:
                            self.model = (await m.json())["data"][0]["id"]
                        break
            await asyncio.sleep(0.3)
        else:
            sys.exit("sluice serve did not become ready")
        if self.args.pin:
            self.pin()

    def worker_procs(self) -> dict[str, psutil.Process]:
        """member name (`local:PORT`) → its worker process."""
        found = {}
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                cmd = child.cmdline()
                if any("workers.cli" in part for part in cmd):
                    found[f"local:{cmd[cmd.index('--port') + 1]}"] = child
        return found

    def pin(self) -> None:
        """Worker i (by port) on cores [i*T, (i+1)*T), every thread of it."""
        cores, t = sorted(os.sched_getaffinity(0)), self.args.worker_threads
        for i, (_, proc) in enumerate(sorted(self.worker_procs().items())):
            mine = set(cores[(i * t) % len(cores) :][:t])
            for thread in proc.threads():
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(thread.id, mine)

    async def metrics(self, session: aiohttp.ClientSession) -> dict[tuple[str, str], float]:
        """(sample name, member or outcome) → value, for the pool's samples."""
        async with session.get(f"{self.base}/metrics") as resp:
            text = await resp.text()
        out = {}
        for family in text_string_to_metric_families(text):
            if family.name.startswith(("sluice_member", "sluice_pool", "sluice_run_migrations")):
                for s in family.samples:  # summed over the labels left out (ejection reasons)
                    label = s.labels.get("member") or s.labels.get("outcome") or ""
                    out[(s.name, label)] = out.get((s.name, label), 0.0) + s.value
        return out

    async def members(self, session: aiohttp.ClientSession) -> list[str]:
        metrics = await self.metrics(session)
        names = {m for (name, m) in metrics if name == "sluice_member_requests_total"}
        return sorted(names)

    async def routed(self, session: aiohttp.ClientSession) -> dict[str, float]:
        metrics = await self.metrics(session)
        return {m: v for (name, m), v in metrics.items() if name == "sluice_member_requests_total"}

    async def stats(self, session: aiohttp.ClientSession, steps: bool = False) -> dict[str, dict]:
        """member → its `/v1/stats`; with `steps`, also `step_s` and `step_n`: the seconds and
        count of its engine steps so far (its `sluice_worker_step_seconds`)."""
        out = {}
        for member in await self.members(session):
            url = f"http://127.0.0.1:{member.rsplit(':', 1)[1]}"
            async with session.get(f"{url}/v1/stats") as resp:
                out[member] = await resp.json()
            if steps:
                async with session.get(f"{url}/metrics") as resp:
                    text = await resp.text()
                for family in text_string_to_metric_families(text):
                    if family.name == "sluice_worker_step_seconds":
                        for s in family.samples:
                            if s.name.endswith(("_sum", "_count")):
                                out[member]["step_s" if s.name.endswith("m") else "step_n"] = (
                                    s.value
                                )
        return out

    async def sample_load(self, session: aiohttp.ClientSession, into: list[tuple[int, ...]]):
        """Each member's waiting + running, every quarter second, into `into`, until cancelled."""
        while True:
            stats = await self.stats(session)
            into.append(tuple(s["waiting"] + s["running"] for _, s in sorted(stats.items())))
            await asyncio.sleep(0.25)

    def cpu_seconds(self) -> float:
        """CPU time of this script, the gateway and its workers (those alive now)."""
        procs = [psutil.Process(), psutil.Process(self.proc.pid)]
        procs += procs[1].children(recursive=True)
        total = 0.0
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                total += times.user + times.system
        return total

    async def warm_up(self, session: aiohttp.ClientSession) -> None:
        """Short unrelated requests until every member has taken engine steps."""
        for attempt in range(10):
            body = {"model": self.model, "max_tokens": 4}
            await asyncio.gather(
                *(
                    stream_chat(
                        session, self.base, {**body, "messages": [user(f"Hi {attempt} {i}")]}
                    )
                    for i in range(2 * self.workers)
                )
            )
            if all(s["steps"] > 0 for s in (await self.stats(session)).values()):
                break
        await asyncio.sleep(1.5)  # the members' load reports settle

    def stop(self) -> None:
        stop_process(self.proc)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def busy_seconds() -> float:
    """CPU time the whole machine spent busy, all cores."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq


@contextlib.contextmanager
def other_cpu(serve: Serve):
    """Yields a dict that gets `cores`: the cores other processes kept busy meanwhile."""
    out: dict[str, float] = {}
    began, busy, ours = time.perf_counter(), busy_seconds(), serve.cpu_seconds()
    yield out
    others = busy_seconds() - busy - (serve.cpu_seconds() - ours)
    out["cores"] = max(0.0, others) / (time.perf_counter() - began)


def user(text: str) -> dict:
    return {"role": "user", "content": text}
