"""End to end, the safety window: a real `sluice serve` on the tiny model with two tenants, one
whose policy blocks any letter at all and one with no policy, through the official `openai`
client. The strict tenant's run ends `content_filter` with nothing of the blocked text sent,
the worker is aborted and gives every KV block back; the other tenant is untouched."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from gateway.backends.local_worker import free_port
from policies.tenants_file import create_key
from tests.support.metrics import scraped
from tests.support.processes import stop, wait_ready
from tests.support.serve import local_worker_url
from tests.support.waiting import until_sync
from tests.support.worker_process import REPO

# NOTE: the tiny random model writes arbitrary characters, so the strict policy blocks the
# first letter of any script (\p{L}); the run is cut off at once, while its worker still works.
TENANTS = """\
[safety.strict]
window_chars = 8
block_terms = ['/\\p{L}/']
redact = ["email", "secret"]

[tenants.strict]
safety = "strict"

[tenants.open]
"""
PROMPT = [{"role": "user", "content": "Tell me everything."}]


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[str, dict[str, str]]]:
    tenants = tmp_path_factory.mktemp("safety-e2e") / "tenants.toml"
    tenants.write_text(TENANTS)
    keys = {name: create_key(tenants, name)[0] for name in ("strict", "open")}
    port = free_port()
    command = [
        *(sys.executable, "-m", "gateway.cli", "serve", "--model", str(tiny_model_dir)),
        *("--dtype", "float32", "--device", "cpu", "--tenants", str(tenants)),
        *("--port", str(port)),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLUICE_LOG_LEVEL": "warning"}
    proc = subprocess.Popen(command, cwd=REPO, env=env)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}/readyz")
        yield f"http://127.0.0.1:{port}", keys
    finally:
        stop(proc)


def client(root: str, key: str) -> OpenAI:
    return OpenAI(base_url=f"{root}/v1", api_key=key, max_retries=0)


def worker_idle(root: str) -> dict:
    url = local_worker_url(root)

    def idle() -> dict | None:
        stats = httpx.get(f"{url}/v1/stats").json()
        return None if stats["running"] or stats["waiting"] else stats

    return until_sync(idle, "the worker to go idle")


def test_the_strict_tenant_is_cut_off_and_the_open_one_is_not(served):
    root, keys = served
    strict, open_ = client(root, keys["strict"]), client(root, keys["open"])
    (model,) = [m.id for m in open_.models.list().data]

    worker = local_worker_url(root)
    generated_before = scraped(worker, "sluice_worker_generated_tokens_total")
    stream = strict.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=900, temperature=0, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert not any(ch.isalpha() for ch in text)  # nothing the policy blocks was sent
    assert chunks[-1].choices[0].finish_reason == "content_filter"
    stored = strict.chat.completions.retrieve(chunks[0].id)
    assert stored.status == "completed" and stored.choices[0].finish_reason == "content_filter"
    # the worker was aborted (source safety), stopped long before 900 tokens, gave back every block
    assert worker_idle(root)["kv_blocks_used"] == 0
    assert scraped(root, "sluice_cancellations_total", source="safety") == 1
    assert 0 < scraped(worker, "sluice_worker_generated_tokens_total") - generated_before < 900

    whole = strict.chat.completions.create(  # greedy: sampled, EOS may come before any letter
        model=model, messages=PROMPT, max_tokens=900, temperature=0
    )
    assert whole.choices[0].finish_reason == "content_filter"
    assert not any(ch.isalpha() for ch in whole.choices[0].message.content or "")

    free = open_.chat.completions.create(  # greedy: the tiny model's EOS is never its argmax
        model=model, messages=PROMPT, max_tokens=24, temperature=0
    )
    assert free.choices[0].finish_reason == "length"
    assert any(ch.isalpha() for ch in free.choices[0].message.content)
    assert worker_idle(root)["kv_blocks_used"] == 0
