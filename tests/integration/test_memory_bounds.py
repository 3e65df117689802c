"""Kept results are bounded by bytes in a real `sluice serve`: the request that used to add
about 130 MB of gateway memory per run (16 choices x 900 tokens, 20 top logprobs each, kept for
the retention time, or for an Idempotency-Key's 24 h) leaves memory flat past a few runs."""

from __future__ import annotations

import httpx
import psutil
import pytest

from tests.support.serve import Served, serving

CAP = 64 << 20
HEAVY = {
    "model": "scripted",
    "n": 16,
    "max_tokens": 900,
    "logprobs": True,
    "top_logprobs": 20,
    "stream": True,
    "messages": [{"role": "user", "content": "Hi"}],
}


def retained(served: Served) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{served.root}/metrics").text.splitlines():
        if line.startswith("sluice_retained_bytes{"):
            what = line.split('what="')[1].split('"')[0]
            out[what] = float(line.rsplit(" ", 1)[1])
    return out


def run_heavy(served: Served, count: int, keyed: bool) -> list[int]:
    """RSS (bytes) of the gateway after each of `count` heavy runs."""
    proc = psutil.Process(served.proc.pid)
    rss = []
    for i in range(count):
        headers = {**served.auth, **({"Idempotency-Key": f"heavy-{i}"} if keyed else {})}
        resp = httpx.post(
            f"{served.base_url}/chat/completions", json=HEAVY, headers=headers, timeout=300
        )
        assert resp.status_code == 200 and resp.content.endswith(b"data: [DONE]\n\n")
        rss.append(proc.memory_info().rss)
    return rss


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "idempotency-keyed"])
def test_memory_stays_flat_under_runs_with_huge_results(scripted_upstream, keyed):
    flags = ["--upstream", f"scripted={scripted_upstream}", "--run-retention-bytes", str(CAP)]
    if keyed:
        flags += ["--run-retention", "1"]  # the runs go; their keys keep the endings (24 h)
    with serving(None, *flags) as served:
        before = psutil.Process(served.proc.pid).memory_info().rss
        rss = run_heavy(served, 12, keyed)
        held = retained(served)
        assert held["runs"] <= CAP + (8 << 20)  # ended runs, plus at most one run's log
        assert held["idempotency"] <= CAP
        # before the bound: ~130 MB more per run (1.6 GB after 12); now it levels off
        assert rss[-1] - before < 320 << 20, [r >> 20 for r in rss]
        assert rss[-1] - rss[5] < 100 << 20, [r >> 20 for r in rss]


def test_a_resume_into_events_dropped_by_the_per_run_cap_is_410(scripted_upstream):
    with serving(None, "--upstream", f"scripted={scripted_upstream}") as served:
        body = httpx.post(
            f"{served.base_url}/chat/completions", json=HEAVY, headers=served.auth, timeout=300
        ).text
        last = [line for line in body.splitlines() if line.startswith("id: ")][-1]
        run_id = body.split('"id":"', 1)[1].split('"', 1)[0]
        url = f"{served.base_url}/chat/completions/{run_id}"

        def resume(after: int) -> httpx.Response:
            params = {"stream": "true", "starting_after": str(after)}
            return httpx.get(url, params=params, headers=served.auth, timeout=30)

        gone = resume(1)  # 25 MB of events: the first ones are past the 8 MiB a run keeps
        assert gone.status_code == 410
        assert gone.json()["error"]["code"] == "resume_window_expired"
        tail = resume(int(last.removeprefix("id: ")) - 3)  # the newest ones are still there
        assert tail.status_code == 200 and tail.text.endswith("data: [DONE]\n\n")
        assert httpx.get(url, headers=served.auth).json()["status"] == "completed"
