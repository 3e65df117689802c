"""End to end, tenants: a tenants file made with `sluice keys`, a real `sluice serve` on the tiny
model, and the official `openai` client. One tenant runs into its requests-per-minute limit,
another has no access to the model; an Idempotency-Key replays; `sluice usage` counts the runs;
a revoked key stops working once the server has reloaded the file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from gateway.backends.local_worker import free_port
from tests.support.processes import stop, wait_ready
from tests.support.waiting import until_sync
from tests.support.worker_process import REPO

TENANTS = """\
[tenants.acme]
rpm = 3
tpm = 100000

[tenants.globex]
rpm = 100
models = ["gpt-4*"]
"""
PROMPT = [{"role": "user", "content": "Say something about tenants."}]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "SLUICE_LOG_LEVEL": "warning"}


def sluice(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )


@dataclass
class Key:
    key: str
    id: str


def create_key(tenants: Path, tenant: str) -> Key:
    made = sluice("keys", "create", "--tenant", tenant, "--tenants", str(tenants))
    key = made.stdout.strip()  # the key alone on stdout; the operator's note on stderr
    (key_id,) = re.findall(r"key id (key_[0-9a-f]+)", made.stderr)
    assert key.startswith("sk-") and key not in made.stderr
    return Key(key, key_id)


@dataclass
class Served:
    base_url: str
    tenants: Path
    usage_file: Path
    acme: Key
    globex: Key

    def client(self, key: Key) -> OpenAI:
        return OpenAI(base_url=self.base_url, api_key=key.key, max_retries=0)


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("tenants-e2e")
    tenants, usage_file = tmp / "tenants.toml", tmp / "usage.jsonl"
    tenants.write_text(TENANTS)
    acme, globex = create_key(tenants, "acme"), create_key(tenants, "globex")
    port = free_port()
    command = [
        *(sys.executable, "-m", "gateway.cli", "serve", "--model", str(tiny_model_dir)),
        *("--dtype", "float32", "--device", "cpu", "--tenants", str(tenants)),
        *("--port", str(port), "--usage-file", str(usage_file)),
    ]
    proc = subprocess.Popen(command, cwd=REPO, env=ENV)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}/readyz")
        yield Served(f"http://127.0.0.1:{port}/v1", tenants, usage_file, acme, globex)
    finally:
        stop(proc)
    assert proc.returncode == 0, "sluice serve did not stop cleanly on SIGTERM"


@pytest.fixture(scope="module")
def model(served) -> str:
    (only,) = served.client(served.acme).models.list().data
    return only.id


def ask(client: OpenAI, model: str, **extra):
    return client.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=4, temperature=0, **extra
    )


def usage_rows(usage_file: Path) -> dict[str, dict[str, str]]:
    """`sluice usage` as {tenant: {column: value}}."""
    out = sluice("usage", "--usage-file", str(usage_file)).stdout.splitlines()
    head = out[0].split()
    return {line.split()[0]: dict(zip(head, line.split(), strict=True)) for line in out[1:]}


def test_a_tenant_without_the_model_is_refused(served, model):
    with pytest.raises(openai.PermissionDeniedError) as refused:
        ask(served.client(served.globex), model)
    assert refused.value.status_code == 403
    assert refused.value.code == "model_not_allowed"


def test_limits_replays_usage_and_revocation(served, model):
    acme = served.client(served.acme)

    raw = acme.chat.completions.with_raw_response.create(
        model=model, messages=PROMPT, max_tokens=4, temperature=0
    )
    assert raw.headers["x-ratelimit-limit-requests"] == "3"
    assert raw.headers["x-ratelimit-remaining-requests"] == "2"
    assert raw.headers["x-ratelimit-limit-tokens"] == "100000"
    for name in ("remaining-tokens", "reset-requests", "reset-tokens"):
        assert raw.headers[f"x-ratelimit-{name}"]
    assert raw.parse().choices[0].message.content is not None

    key = {"Idempotency-Key": "acme-order-42"}
    first = ask(acme, model, extra_headers=key)
    again = ask(acme, model, extra_headers=key)  # a replay: no new run, no request counted
    assert again.id == first.id
    assert again.choices[0].message.content == first.choices[0].message.content

    third = ask(acme, model)
    assert third.id not in (first.id, raw.parse().id)
    with pytest.raises(openai.RateLimitError) as limited:
        ask(acme, model)
    assert limited.value.code == "rate_limit_exceeded"
    assert int(limited.value.response.headers["retry-after"]) >= 1

    def settled() -> dict | None:  # a run's record is written as it settles, after its answer
        rows = usage_rows(served.usage_file)
        return rows if rows.get("acme", {}).get("runs") == "3" else None

    rows = until_sync(settled, "three usage records")
    assert rows["acme"]["runs"] == rows["acme"]["completed"] == "3"
    assert rows["acme"]["model"] == model
    assert "globex" not in rows  # refused before any run

    sluice("keys", "revoke", served.acme.id, "--tenants", str(served.tenants))

    def refused() -> bool:
        try:
            acme.models.list()
        except openai.AuthenticationError:
            return True
        return False

    until_sync(refused, "the revoked key to stop working", within=6)  # the file is polled: 2 s
    with pytest.raises(openai.AuthenticationError) as denied:
        ask(acme, model)
    assert denied.value.status_code == 401
    # the other tenant's key was not touched by the reload
    assert served.client(served.globex).models.list().data
