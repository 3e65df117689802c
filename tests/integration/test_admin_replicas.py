"""The admin API on real `sluice serve` processes (design §11): two gateways sharing one Redis
with `--tenants-store redis` see a tenant and key made on one replica, and a revocation, within
2 s on the other; `sluice audit` and `sluice tenants push | pull` read and move the same store;
in file mode the API edits the file the gateway reloads, and `sluice audit` reads its log."""

from __future__ import annotations

import getpass
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import orjson
import pytest
import redis

from policies.tenants import load_tenants
from tests.support.redis_scratch import REDIS_URL
from tests.support.serve import Served, serving
from tests.support.waiting import until_sync

ADMIN_KEY = "sk-admin-replicas-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROPAGATION = 2.0  # seconds: what the admin API promises every replica
TENANTS = """\
# the first push to Redis carries this file
[tenants.acme]
rpm = 600  # requests per minute
"""


@pytest.fixture
def prefix() -> Iterator[str]:
    """A Redis key prefix of this test's own, its keys deleted afterwards."""
    name = f"sluice-test-{uuid.uuid4().hex[:12]}:"
    yield name
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{name}*"))
    if keys:
        client.delete(*keys)
    client.close()


def sluice(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, timeout=60
    )


def chat(gateway: Served, key: str) -> int:
    body = {"model": "scripted", "messages": [{"role": "user", "content": "Hi"}]}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(
        f"{gateway.base_url}/chat/completions", json=body, headers=headers
    ).status_code


def within(check, what: str) -> float:
    """Seconds until `check()` holds, failing past PROPAGATION."""
    started = time.monotonic()
    until_sync(check, what, within=PROPAGATION)
    return time.monotonic() - started


@pytest.mark.redis
def test_a_key_made_on_one_replica_works_on_the_other_and_its_revocation_too(
    tmp_path: Path, prefix: str, scripted_upstream: str
):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    flags = (
        *("--upstream", f"scripted={scripted_upstream}", "--admin-key", ADMIN_KEY),
        *("--tenants", str(tenants), "--tenants-store", "redis"),
        *("--redis-url", REDIS_URL, "--redis-prefix", prefix),
    )
    with ExitStack() as stack:
        a, b = (stack.enter_context(serving(None, *flags)) for _ in range(2))
        made = httpx.post(f"{a.root}/admin/tenants", json={"name": "gamma"}, headers=ADMIN)
        assert made.status_code == 201
        key = httpx.post(f"{a.root}/admin/tenants/gamma/keys", headers=ADMIN).json()
        assert chat(a, key["key"]) == 200
        within(lambda: chat(b, key["key"]) == 200, "the new key to work on the other replica")
        gone = httpx.delete(f"{b.root}/admin/keys/{key['id']}", headers=ADMIN)
        assert gone.status_code == 200
        assert chat(b, key["key"]) == 401
        within(lambda: chat(a, key["key"]) == 401, "the revoked key to be refused on the other")
        # the file was pushed once and is ignored since: an edit of it changes nothing
        tenants.write_text(TENANTS + "\n[tenants.ignored]\n")
        listed = httpx.get(f"{a.root}/admin/tenants", headers=ADMIN).json()["data"]
        assert [t["name"] for t in listed] == ["acme", "gamma"]

    store = ("--tenants-store", "redis", "--redis-url", REDIS_URL, "--redis-prefix", prefix)
    audit = sluice("audit", "--json", "--since", "1h", *store)
    assert audit.returncode == 0, audit.stderr
    records = [orjson.loads(line) for line in audit.stdout.splitlines()]
    assert [r["action"] for r in records] == ["tenant.create", "key.create", "key.revoke"]
    assert key["key"] not in audit.stdout and "sha256:" not in audit.stdout
    assert ADMIN_KEY not in audit.stdout

    pulled = tmp_path / "pulled.toml"
    redis_flags = ("--redis-url", REDIS_URL, "--redis-prefix", prefix)
    done = sluice("tenants", "pull", "--tenants", str(pulled), *redis_flags)
    assert done.returncode == 0, done.stderr
    assert set(load_tenants(pulled).tenants) == {"acme", "gamma"}
    assert "rpm = 600  # requests per minute" in pulled.read_text()
    done = sluice("tenants", "push", "--tenants", str(tenants), *redis_flags)
    assert done.returncode == 0, done.stderr
    pulled.unlink()
    sluice("tenants", "pull", "--tenants", str(pulled), *redis_flags)
    assert set(load_tenants(pulled).tenants) == {"acme", "ignored"}


@pytest.mark.process  # `sluice audit` as a subprocess
def test_file_mode_edits_the_file_the_gateway_reloads_and_sluice_audit_reads_its_log(
    tmp_path: Path, scripted_upstream: str
):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    made = sluice("keys", "create", "--tenant", "acme", "--tenants", str(tenants))
    assert made.returncode == 0, made.stderr
    flags = ("--upstream", f"scripted={scripted_upstream}", "--tenants", str(tenants))
    with serving(None, *flags, env={"SLUICE_ADMIN_KEY": ADMIN_KEY}) as gateway:
        key = httpx.post(f"{gateway.root}/admin/tenants/acme/keys", headers=ADMIN).json()
        assert chat(gateway, key["key"]) == 200
        edited = httpx.patch(f"{gateway.root}/admin/tenants/acme", json={"rpm": 1}, headers=ADMIN)
        assert edited.json()["rpm"] == 1
        assert "rpm = 1  # requests per minute" in tenants.read_text()
        refused = chat(gateway, key["key"])  # the second request this minute
        assert refused == 429
    audit = sluice("audit", "--tenants", str(tenants))
    assert audit.returncode == 0, audit.stderr
    lines = audit.stdout.splitlines()
    assert [line.split()[1:3] for line in lines] == [
        [f"cli:{getpass.getuser()}", "key.create"],  # `sluice keys` is audited too
        [lines[1].split()[1], "key.create"],
        [lines[1].split()[1], "tenant.update"],
    ]
    assert lines[1].split()[1].startswith("admin:key_")
    assert '{"rpm":600} -> {"rpm":1}' in lines[2]
    assert made.stdout.strip() not in audit.stdout  # the key printed once, never logged
