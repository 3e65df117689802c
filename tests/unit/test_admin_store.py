"""The admin API's pieces on their own: tenant edits checked by the tenants file's parser, the
file store's atomic in-place writes, the audit log's two stores, usage sums with and without
cost, who counts as an admin (keys, JWT roles, tenant credentials), and replicas following
the tenants in Redis."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace
from pathlib import Path

import jwt
import pytest
import tomlkit
from structlog.testing import capture_logs

from gateway.admin import tenant_doc
from gateway.admin.audit import AuditRecord, FileAuditLog, RedisAuditLog, audit_path
from gateway.admin.auth import AdminAuth
from gateway.admin.tenant_store import FileTenantStore
from gateway.admin.tenant_store_redis import RedisTenantStore
from gateway.admin.tenant_sync import first_load, follow_versions
from gateway.admin.usage import usage_rows
from gateway.http.errors import APIError
from gateway.state.ledger import UsageRecord
from gateway.tasks import stop_tasks
from policies.auth import Authenticator
from policies.tenants import load_tenants, parse_text
from policies.tenants_file import create_key
from tests.support.redis_scratch import scratch_redis
from tests.support.waiting import until

TEXT = """\
# comment on top
[tenants.acme]
rpm = 600  # per minute
tiers = ["default", "flex"]
"""
SECRET = "s" * 40


def test_set_fields_reports_only_what_changed_and_a_null_removes_a_field():
    doc = tomlkit.parse(TEXT)
    change = tenant_doc.set_fields(doc, "acme", {"rpm": 600, "tpm": 10, "tiers": None})
    assert (change.before, change.after) == (
        {"tiers": ["default", "flex"], "tpm": None},
        {"tiers": None, "tpm": 10},
    )
    assert (
        tomlkit.dumps(doc)
        == "# comment on top\n[tenants.acme]\nrpm = 600  # per minute\ntpm = 10\n"
    )


def test_check_names_the_field_the_parser_refuses():
    doc = tomlkit.parse(TEXT)
    tenant_doc.set_fields(doc, "acme", {"default_tier": "priority"})
    with pytest.raises(tenant_doc.BadField) as refused:
        tenant_doc.check(doc, "tenants.toml")
    assert refused.value.field == "default_tier"
    assert not refused.value.message.startswith("tenants.toml")


@pytest.mark.parametrize("name", ["", "a b", "a.b", "x" * 65, 7, None])
def test_tenant_names_are_bare_toml_keys(name):
    with pytest.raises(tenant_doc.BadField) as refused:
        tenant_doc.check_name(name)
    assert refused.value.field == "name"


async def test_the_file_store_writes_in_place_atomically_and_never_a_refused_file(tmp_path: Path):
    path = tmp_path / "tenants.toml"
    path.write_text(TEXT)
    store = FileTenantStore(path)
    inode = path.stat().st_ino
    _, config = await store.edit(lambda d: tenant_doc.set_fields(d, "acme", {"rpm": 5}))
    assert (
        config.tenants["acme"].limits.rpm == 5
        and load_tenants(path).tenants["acme"].limits.rpm == 5
    )
    assert path.stat().st_ino != inode  # replaced by a rename, never rewritten in place
    with pytest.raises(tenant_doc.BadField):
        await store.edit(lambda d: tenant_doc.set_fields(d, "acme", {"rpm": 0}))
    assert "rpm = 5  # per minute" in path.read_text()
    assert [name for name in os.listdir(tmp_path) if name.endswith(".tmp")] == []


@pytest.mark.redis
async def test_the_redis_store_is_a_compare_and_set_of_the_whole_document():
    async with scratch_redis() as (client, prefix):
        store = RedisTenantStore(client, prefix)
        assert await store.config() is None and await store.version() == 0
        assert await store.push(TEXT, only_if_empty=True)
        assert not await store.push("[tenants.other]\n", only_if_empty=True)
        assert await store.version() == 1

        await store.edit(lambda d: tenant_doc.set_fields(d, "acme", {"rpm": 9}))
        config = await store.config()
        assert config.tenants["acme"].limits.rpm == 9 and await store.version() == 2
        text, version = await store.text()
        assert "rpm = 9  # per minute" in text and version == "2"
        assert await store._store("[tenants.x]\n", "1") == -1  # a stale version is refused


@pytest.mark.redis
async def test_audit_records_read_back_in_order_from_a_file_and_from_redis(tmp_path: Path):
    now = time.time()
    old = AuditRecord(
        "admin:key_1", "tenant.update", "acme", "acme", {"rpm": 1}, {"rpm": 2}, now - 7200
    )
    new = AuditRecord("jwt:ops", "key.create", "key_abc", "acme", {}, {"id": "key_abc"}, now)
    file_log = FileAuditLog(audit_path(tmp_path / "tenants.toml"))
    assert file_log.path == tmp_path / "tenants.audit.jsonl"
    async with scratch_redis() as (client, prefix):
        for log in (file_log, RedisAuditLog(client, prefix)):
            assert await log.read() == []
            await log.append(old)
            await log.append(new)
            assert await log.read() == [old, new]
            assert await log.read(since=now - 60) == [new]


def record(tenant: str, model: str, ended_at: float, **more) -> UsageRecord:
    fields = dict(
        run_id=f"r{ended_at}", tenant=tenant, principal="key_1", model=model, status="completed",
        finish_reason="stop", cancel_source=None, prompt_tokens=10, generated_tokens=5,
        sent_tokens=5, tail_tokens=0, ttft_s=0.1, e2e_s=0.2, ended_at=ended_at,
    )  # fmt: skip
    return UsageRecord(**fields, **more)


async def aiter(items):
    for item in items:
        yield item


async def test_usage_rows_group_by_day_and_cost_is_null_until_a_record_has_one():
    day1, day2 = 1_767_225_600.0, 1_767_225_600.0 + 86400  # 2026-01-01, 2026-01-02 UTC
    records = [record("acme", "m", day1), record("acme", "m", day1 + 60), record("acme", "m", day2)]
    rows = await usage_rows(aiter(records), None, "day")
    assert [(r["day"], r["runs"], r["total_tokens"], r["cost"]) for r in rows] == [
        ("2026-01-01", 2, 30, None),
        ("2026-01-02", 1, 15, None),
    ]
    costed = [replace(records[0], cost=0.25), records[1], replace(records[2], cost=0.5)]
    rows = await usage_rows(aiter(costed), "m", None)
    assert [(r["runs"], r["cost"]) for r in rows] == [(3, 0.75)]
    assert await usage_rows(aiter(records), "other", None) == []


def _admin_auth(tmp_path: Path, admin_keys: list[str], monkeypatch) -> tuple[AdminAuth, str]:
    monkeypatch.setenv("TEST_ADMIN_JWT_SECRET", SECRET)
    path = tmp_path / "tenants.toml"
    path.write_text(
        '[jwt]\nalgorithms = ["HS256"]\nhs256_secret_env = "TEST_ADMIN_JWT_SECRET"\n'
        "[tenants.acme]\n"
    )
    tenant_key, _ = create_key(path, "acme")
    return AdminAuth(admin_keys, Authenticator(load_tenants(path))), tenant_key


def token(**claims) -> str:
    return "Bearer " + jwt.encode({"exp": time.time() + 60, **claims}, SECRET, "HS256")


def status_of(auth: AdminAuth, header: str | None) -> int | str:
    try:
        return auth.identify(header)
    except APIError as exc:
        return exc.status


def test_admins_are_their_keys_or_tokens_with_the_role_and_tenants_are_refused(
    tmp_path, monkeypatch
):
    auth, tenant_key = _admin_auth(tmp_path, ["admin-one", "admin-two"], monkeypatch)
    assert status_of(auth, "Bearer admin-two").startswith("admin:key_")
    assert "admin-two" not in status_of(auth, "Bearer admin-two")
    assert status_of(auth, token(sub="ops", roles=["sluice-admin"])) == "jwt:ops"
    assert status_of(auth, token(sub="ops", roles="sluice-admin")) == "jwt:ops"
    assert status_of(auth, token(sub="ops", tenant="acme", roles=["reader"])) == 403
    assert status_of(auth, token(sub="ops", tenant="acme")) == 403
    assert status_of(auth, f"Bearer {tenant_key}") == 403
    assert status_of(auth, "Bearer nobody") == 401
    assert status_of(auth, None) == 401
    forged = "Bearer " + jwt.encode({"exp": time.time() + 60, "roles": ["sluice-admin"]}, "x" * 40)
    assert status_of(auth, forged) == 401


def test_without_admin_keys_or_jwt_the_admin_api_is_not_there(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.acme]\n")
    key, _ = create_key(path, "acme")
    auth = AdminAuth([], Authenticator(load_tenants(path)))
    assert not auth.enabled
    assert status_of(auth, f"Bearer {key}") == 404


def test_the_tenants_parser_still_loads_what_the_edit_helpers_write(tmp_path):
    doc = tomlkit.parse(TEXT)
    tenant_doc.set_fields(doc, "new", {"weight": 2, "max_queued": 3}, create=True)
    config = parse_text(tomlkit.dumps(doc), tmp_path / "t.toml")
    assert replace(config.tenants["new"].sharing).weight == 2.0


@pytest.mark.redis
async def test_replicas_follow_the_version_in_redis_and_only_warn_when_the_file_changes(tmp_path):
    file = tmp_path / "tenants.toml"
    file.write_text(TEXT)
    applied = []
    async with scratch_redis() as (client, prefix):
        store = RedisTenantStore(client, prefix)
        version = await first_load(store, str(file), applied.append)
        assert version == 1 and [c.tenants["acme"].limits.rpm for c in applied] == [600]
        with capture_logs() as logs:
            follow = follow_versions(
                store, applied.append, asyncio.Event(), version, str(file), 0.01
            )
            task = asyncio.create_task(follow)
            await store.edit(lambda d: tenant_doc.set_fields(d, "acme", {"rpm": 7}))
            await until(lambda: len(applied) == 2, "the new version to be applied")
            file.write_text(TEXT + "\n[tenants.ignored]\n")
            warned = "tenants file changed but tenants live in Redis"
            await until(lambda: any(warned in e["event"] for e in logs), "the warning")
            await stop_tasks([task])
        assert [c.tenants["acme"].limits.rpm for c in applied] == [600, 7]
        assert "ignored" not in (await store.text())[0]
