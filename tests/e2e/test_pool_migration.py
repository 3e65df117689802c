"""A worker killed mid-stream under a real `sluice serve --workers 2` on the tiny model: its runs
continue on the other member from the exact token, so every client's greedy text equals the
uninterrupted run's, its event ids run 1..K without a gap, and the ledger has one record per run.
A worker that stops answering mid-stream (SIGSTOP: it accepts connections and never answers)
has its runs moved the same way once it misses its probes. (That the dead worker is restarted
and rejoins is test_pool_faults.py's.)"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

from tests.e2e.test_pool_faults import healthy_members, workers
from tests.e2e.test_worker_faults import metric, model_id
from tests.support.serve import Served, serving
from tests.support.waiting import until_sync

# alone (tests/support/tiers.py): it times how soon a killed or silent member is left
pytestmark = pytest.mark.alone

STREAMS = 6
MAX_TOKENS = 300
CUT_AFTER = 12  # content chunks every stream has before the kill


class Stream:
    """One raw SSE stream read on its own thread: its event ids, text and ending."""

    def __init__(self, gateway: Served, prompt: str) -> None:
        self.gateway, self.prompt = gateway, prompt
        self.ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.errors: list[dict] = []
        self.done = False
        self.chunks = 0
        self.usage: dict | None = None
        self.run_id: str | None = None

    def run(self) -> Stream:
        body = {
            "model": model_id(self.gateway),
            "messages": [{"role": "user", "content": self.prompt}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        url = f"{self.gateway.base_url}/chat/completions"
        with httpx.stream("POST", url, json=body, headers=self.gateway.auth, timeout=60) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                self._line(line)
        return self

    def _line(self, line: str) -> None:
        if line.startswith("id:"):
            self.ids.append(int(line[3:]))
        elif line == "data: [DONE]":
            self.done = True
        elif line.startswith("data:"):
            event = json.loads(line[5:])
            self.run_id = event.get("id", self.run_id)
            if "error" in event:
                self.errors.append(event["error"])
            if event.get("usage"):
                self.usage = event["usage"]
            for choice in event.get("choices", []):
                self.text += choice["delta"].get("content") or ""
                self.chunks += bool(choice["delta"].get("content"))
                self.finish_reason = choice.get("finish_reason") or self.finish_reason


def running(proc: psutil.Process) -> int:
    """Requests running on a worker process now, as it reports."""
    port = proc.cmdline()[proc.cmdline().index("--port") + 1]
    return httpx.get(f"http://127.0.0.1:{port}/v1/stats").json()["running"]


def running_or_none(proc: psutil.Process) -> int:
    """`running`, or -1 for a worker not listening yet (one restarted by an earlier test may
    still be loading its model): it runs nothing."""
    try:
        return running(proc)
    except httpx.ConnectError:
        return -1


def busiest_worker(gateway: Served) -> psutil.Process:
    """The local worker with the most requests running now."""
    return max(workers(gateway), key=running_or_none)


@pytest.fixture(scope="module")
def pool_of_two(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[Served, Path]]:
    ledger = tmp_path_factory.mktemp("ledger") / "usage.jsonl"
    with serving(tiny_model_dir, "--workers", "2", "--usage-file", str(ledger)) as gateway:
        yield gateway, ledger


def cut_mid_stream(
    gateway: Served, cut: Callable[[], Callable[[], None]], tag: str
) -> tuple[list[Stream], dict]:
    """Greedy streams, uninterrupted first, then again with `cut()` once every stream is live
    (it returns what undoes the cut, run when the streams are over); the cut streams and the
    uninterrupted answers."""
    until_sync(lambda: healthy_members(gateway) == 2, "both members to be healthy", within=60)
    client = OpenAI(base_url=gateway.base_url, api_key=gateway.key, max_retries=0)
    prompts = [f"Tell me a story about the number {i} ({tag})." for i in range(STREAMS)]

    def uninterrupted(prompt: str):
        return client.chat.completions.create(
            model=model_id(gateway),
            messages=[{"role": "user", "content": prompt}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )

    with ThreadPoolExecutor(STREAMS) as pool:
        reference = dict(zip(prompts, pool.map(uninterrupted, prompts), strict=True))
    streams = [Stream(gateway, p) for p in prompts]
    with ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(s.run) for s in streams]
        until_sync(lambda: all(s.chunks >= CUT_AFTER for s in streams), "streams to be live")
        undo = cut()
        try:
            for future in futures:
                future.result(timeout=120)
        finally:
            undo()
    return streams, reference


def signal_busiest(gateway: Served, signum: int, undo: int | None = None):
    """A cut: `signum` to the busiest local worker (`undo`, if any, to it afterwards)."""

    def cut() -> Callable[[], None]:
        victim = busiest_worker(gateway)
        victim.send_signal(signum)
        return lambda: undo is None or victim.send_signal(undo)

    return cut


def assert_as_if_uninterrupted(streams: list[Stream], reference: dict) -> None:
    for stream in streams:
        want = reference[stream.prompt]
        assert stream.errors == [] and stream.done
        assert stream.text == want.choices[0].message.content
        assert stream.finish_reason == want.choices[0].finish_reason
        assert stream.ids == list(range(1, len(stream.ids) + 1))  # no gap, none twice
        assert stream.usage["completion_tokens"] == want.usage.completion_tokens
        assert stream.usage["prompt_tokens"] == want.usage.prompt_tokens


def test_a_worker_killed_mid_stream_costs_its_clients_nothing(pool_of_two):
    gateway, ledger = pool_of_two
    streams, reference = cut_mid_stream(gateway, signal_busiest(gateway, signal.SIGKILL), "kill")
    assert metric(gateway, "sluice_run_migrations_total", outcome="continued") >= 1
    assert_as_if_uninterrupted(streams, reference)
    runs = [json.loads(line)["run_id"] for line in ledger.read_text().splitlines()]
    for run_id in [s.run_id for s in streams] + [r.id for r in reference.values()]:
        assert runs.count(run_id) == 1  # one usage record per run, cut or not


def test_a_worker_that_stops_answering_mid_stream_has_its_runs_moved(pool_of_two):
    gateway, _ = pool_of_two
    moved = metric(gateway, "sluice_run_migrations_total", outcome="continued")
    hang = signal_busiest(gateway, signal.SIGSTOP, undo=signal.SIGCONT)  # accepts, never answers
    streams, reference = cut_mid_stream(gateway, hang, "stop")
    assert metric(gateway, "sluice_run_migrations_total", outcome="continued") > moved
    assert_as_if_uninterrupted(streams, reference)
