"""A WHATWG EventSource (the `eventsource` npm package under node) follows a run with nothing
but its URL and follow token, through a connection cut mid-stream, and stops by itself at the
end: every event exactly once, the run's whole text, then no more reconnects (the 204)."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import orjson
import pytest

from tests.browser.conftest import BROWSER_KEY
from tests.support.tcp_proxy import TcpProxy

NODE_DIR = Path(__file__).parent / "node"
AUTH = {"Authorization": f"Bearer {BROWSER_KEY}"}


@pytest.fixture(scope="session")
def eventsource_package() -> Path:
    """node with the locked `eventsource` package (installed by `npm ci` when missing)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed (.ci/run installs them)")
    if not (NODE_DIR / "node_modules" / "eventsource").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, check=True)
    return NODE_DIR / "follow.mjs"


@contextmanager
def live_run(served, model: str) -> Iterator[tuple[str, str]]:
    """(run id, follow token) of a greedy streamed run while it goes on: its own stream is read
    on by a thread, as its first client would, until the end."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me a story about 你好 and café."}],
        "max_tokens": 600,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{served.base_url}/chat/completions", json=body, headers=AUTH, timeout=60
    ) as resp:
        assert resp.status_code == 200
        chunks = resp.iter_raw()
        head = b""
        while b'"id":"' not in head or b"\n\n" not in head:
            head += next(chunks)
        run_id = head.split(b'"id":"', 1)[1].split(b'"', 1)[0].decode()
        reader = threading.Thread(target=lambda: [None for _ in chunks], daemon=True)
        reader.start()
        yield run_id, resp.headers["x-follow-token"]
        reader.join(60)


def test_an_eventsource_follows_a_run_through_a_cut_and_stops_at_its_end(
    served, proxy: TcpProxy, eventsource_package
):
    (model,) = httpx.get(f"{served.base_url}/models", headers=AUTH).json()["data"]
    proxy.cut_streams_after(1500)  # a few frames in, wherever that falls
    with live_run(served, model["id"]) as (run_id, token):
        url = f"{proxy.root}/v1/chat/completions/{run_id}?stream=true&token={token}"
        done = subprocess.run(
            ["node", str(eventsource_package), url], capture_output=True, timeout=120, text=True
        )
    stored = httpx.get(f"{served.base_url}/chat/completions/{run_id}", headers=AUTH).json()
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]

    assert proxy.cuts == 1
    assert [line for line in lines if "open" in line] == [{"open": 1}, {"open": 2}]
    assert lines[-1] == {"closed": True}  # it gave up by itself: the 204
    assert lines[-2]["error"] == 204
    messages = [line for line in lines if "data" in line]
    assert [m["data"] for m in messages].count("[DONE]") == 1 and messages[-1]["data"] == "[DONE]"
    ids = [int(m["id"]) for m in messages[:-1]]
    assert ids == sorted(set(ids)), "an event came twice or out of order"
    reopened = lines.index({"open": 2})
    assert any("data" in line for line in lines[reopened:-3]), "nothing came after the cut"
    text = "".join(
        choice["delta"].get("content") or ""
        for m in messages[:-1]
        for choice in orjson.loads(m["data"])["choices"]
    )
    assert text == stored["choices"][0]["message"]["content"]
    assert stored["status"] == "completed"
