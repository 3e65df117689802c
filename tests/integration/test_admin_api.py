"""The admin API through the real app (design §11), on a tenants file and, where the store
matters, on a real Redis: tenants created, edited and deleted in place (comments and order
kept), keys made once and revoked, every change audited without a secret, usage summed from
the ledger, and every bad input a 400 naming its field."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from adapters.events import Finish, TextDelta, Usage
from gateway.admin.audit import audit_path
from policies.tenants import load_tenants
from policies.tenants_file import create_key
from testkit.scripted_adapter import ScriptedAdapter
from tests.support.gateway import chat_body, gateway_app

ADMIN_KEY = "sk-admin-test-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
TENANTS = """\
# who may call (a comment the admin API keeps)
[tenants.acme]
rpm = 600  # requests per minute
models = ["*"]

# the second tenant
[tenants.beta]
weight = 2
"""


def script(request) -> list:
    return [TextDelta("hi"), Finish("stop"), Usage(3, 2)]


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    return path


async def admin_client(aiohttp_client, tenants_file: Path | None, **settings):
    app = gateway_app(
        adapters=[ScriptedAdapter("scripted", script)],
        tenants=None if tenants_file is None else str(tenants_file),
        admin_key=[ADMIN_KEY],
        api_key=[],
        usage_file=str((tenants_file or Path("/tmp")).parent / "usage.jsonl"),
        **settings,
    )
    return await aiohttp_client(app)


async def error_of(resp) -> dict:
    return (await resp.json())["error"]


async def test_a_tenant_made_edited_and_deleted_keeps_the_files_comments_and_order(
    aiohttp_client, tenants_file
):
    client = await admin_client(aiohttp_client, tenants_file)
    made = await client.post("/admin/tenants", json={"name": "gamma", "tpm": 5000}, headers=ADMIN)
    assert made.status == 201
    assert await made.json() == {"object": "tenant", "name": "gamma", "tpm": 5000, "keys": []}
    edited = await client.patch("/admin/tenants/acme", json={"rpm": 700}, headers=ADMIN)
    assert (await edited.json())["rpm"] == 700
    text = tenants_file.read_text()
    assert "rpm = 700  # requests per minute" in text
    assert text.index("# who may call") < text.index("[tenants.acme]") < text.index("# the second")
    assert text.index("[tenants.beta]") < text.index("[tenants.gamma]")
    gone = await client.delete("/admin/tenants/beta", headers=ADMIN)
    assert (await gone.json())["deleted"] is True
    assert set(load_tenants(tenants_file).tenants) == {"acme", "gamma"}
    listed = await (await client.get("/admin/tenants", headers=ADMIN)).json()
    assert [t["name"] for t in listed["data"]] == ["acme", "gamma"]


async def test_a_new_key_is_answered_once_works_at_once_and_stops_when_revoked(
    aiohttp_client, tenants_file
):
    client = await admin_client(aiohttp_client, tenants_file)
    made = await client.post("/admin/tenants/acme/keys", headers=ADMIN)
    assert made.status == 201
    body = await made.json()
    key, key_id = body["key"], body["id"]
    assert key not in tenants_file.read_text()  # only its hash is stored
    shown = await (await client.get("/admin/tenants/acme", headers=ADMIN)).json()
    assert shown["keys"] == [{"id": key_id, "created": body["created"]}]
    user = {"Authorization": f"Bearer {key}"}
    ok = await client.post("/v1/chat/completions", json=chat_body(), headers=user)
    assert ok.status == 200  # this replica applied the change before answering
    revoked = await client.delete(f"/admin/keys/{key_id}", headers=ADMIN)
    assert (await revoked.json()) == {
        "object": "key.deleted",
        "id": key_id,
        "tenant": "acme",
        "deleted": True,
    }
    refused = await client.post("/v1/chat/completions", json=chat_body(), headers=user)
    assert refused.status == 401
    again = await client.delete(f"/admin/keys/{key_id}", headers=ADMIN)
    assert (again.status, (await error_of(again))["code"]) == (404, "key_not_found")


async def test_every_change_is_audited_with_before_and_after_and_no_secret(
    aiohttp_client, tenants_file
):
    client = await admin_client(aiohttp_client, tenants_file)
    await client.patch("/admin/tenants/acme", json={"rpm": 700, "tpm": 9000}, headers=ADMIN)
    key = await (await client.post("/admin/tenants/acme/keys", headers=ADMIN)).json()
    await client.delete(f"/admin/keys/{key['id']}", headers=ADMIN)
    await client.delete("/admin/tenants/beta", headers=ADMIN)
    records = (await (await client.get("/admin/audit?since=1h", headers=ADMIN)).json())["data"]
    assert [r["action"] for r in records] == [
        "tenant.update",
        "key.create",
        "key.revoke",
        "tenant.delete",
    ]
    update = records[0]
    assert (update["before"], update["after"]) == (
        {"rpm": 600, "tpm": None},
        {"rpm": 700, "tpm": 9000},
    )
    assert update["who"].startswith("admin:key_") and ADMIN_KEY not in update["who"]
    assert records[3]["before"] == {"weight": 2}
    raw = audit_path(tenants_file).read_bytes()
    assert (
        key["key"].encode() not in raw and b"sha256:" not in raw and ADMIN_KEY.encode() not in raw
    )
    assert [orjson.loads(line)["action"] for line in raw.splitlines()] == [
        r["action"] for r in records
    ]


@pytest.mark.parametrize(
    ("method", "path", "body", "param"),
    [
        ("PATCH", "/admin/tenants/acme", {"rpm": -1}, "rpm"),
        ("PATCH", "/admin/tenants/acme", {"rpmm": 5}, "rpmm"),
        ("PATCH", "/admin/tenants/acme", {"weight": "heavy"}, "weight"),
        ("PATCH", "/admin/tenants/acme", {"tiers": ["gold"]}, "tiers"),
        ("PATCH", "/admin/tenants/acme", {"default_tier": "priority"}, "default_tier"),
        ("PATCH", "/admin/tenants/acme", {"max_queued": 0}, "max_queued"),
        ("PATCH", "/admin/tenants/acme", {"safety": "nope"}, "safety"),
        ("PATCH", "/admin/tenants/acme", {"models": "gpt"}, "models"),
        ("PATCH", "/admin/tenants/acme", {"budget_tokens": 10}, "budget_period"),
        ("PATCH", "/admin/tenants/acme", {"keys": []}, "keys"),
        ("PATCH", "/admin/tenants/acme", {"name": "other"}, "name"),
        ("PATCH", "/admin/tenants/acme", {"total_timeout": {"a": 1}}, "total_timeout"),
        ("POST", "/admin/tenants", {"name": "bad name"}, "name"),
        ("POST", "/admin/tenants", {"tpm": 5}, "name"),
        ("POST", "/admin/tenants", {"name": "x", "rpm": True}, "rpm"),
        ("GET", "/admin/usage?group_by=week", None, "group_by"),
        ("GET", "/admin/usage?since=yesterday", None, "since"),
        ("GET", "/admin/audit?since=soon", None, "since"),
    ],
)
async def test_every_bad_input_is_a_400_naming_the_field_and_changes_nothing(
    aiohttp_client, tenants_file, method, path, body, param
):
    client = await admin_client(aiohttp_client, tenants_file)
    resp = await client.request(method, path, json=body, headers=ADMIN)
    assert resp.status == 400
    error = await error_of(resp)
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert tenants_file.read_text() == TENANTS
    assert not audit_path(tenants_file).exists()


async def test_unknown_and_existing_tenants_and_a_body_that_is_not_an_object(
    aiohttp_client, tenants_file
):
    client = await admin_client(aiohttp_client, tenants_file)
    missing = await client.patch("/admin/tenants/nobody", json={"rpm": 1}, headers=ADMIN)
    assert (missing.status, (await error_of(missing))["code"]) == (404, "tenant_not_found")
    twice = await client.post("/admin/tenants", json={"name": "acme"}, headers=ADMIN)
    assert (twice.status, (await error_of(twice))["code"]) == (409, "tenant_exists")
    listed = await client.patch("/admin/tenants/acme", json=[1], headers=ADMIN)
    assert listed.status == 400
    not_json = await client.patch("/admin/tenants/acme", data=b"rpm=1", headers=ADMIN)
    assert not_json.status == 415


async def test_only_admin_credentials_reach_the_admin_api(aiohttp_client, tenants_file):
    tenant_key, _ = create_key(tenants_file, "acme")
    client = await admin_client(aiohttp_client, tenants_file)
    for headers, status, code in [
        ({}, 401, "invalid_api_key"),
        ({"Authorization": "Bearer sk-sluice-nobody"}, 401, "invalid_api_key"),
        ({"Authorization": f"Bearer {tenant_key}"}, 403, "permission_denied"),
    ]:
        resp = await client.get("/admin/tenants", headers=headers)
        assert (resp.status, (await error_of(resp))["code"]) == (status, code)
    # and an admin key is no tenant key
    chat = await client.post("/v1/chat/completions", json=chat_body(), headers=ADMIN)
    assert chat.status == 401


async def test_without_an_admin_credential_the_admin_api_and_page_are_not_there(
    aiohttp_client, tenants_file
):
    tenant_key, _ = create_key(tenants_file, "acme")
    app = gateway_app(
        adapters=[ScriptedAdapter("scripted", script)], tenants=str(tenants_file), api_key=[]
    )
    client = await aiohttp_client(app)
    for path in ("/admin", "/admin/tenants", "/admin/audit"):
        resp = await client.get(path, headers={"Authorization": f"Bearer {tenant_key}"})
        assert (resp.status, (await error_of(resp))["code"]) == (404, "not_found")


async def test_usage_sums_tokens_and_cost_per_tenant_model_and_day(aiohttp_client, tenants_file):
    tenant_key, _ = create_key(tenants_file, "acme")
    prices = {"scripted": {"input_per_million": 1_000_000.0, "output_per_million": 2_000_000.0}}
    client = await admin_client(aiohttp_client, tenants_file, prices=prices)
    user = {"Authorization": f"Bearer {tenant_key}"}
    for _ in range(3):
        assert (
            await client.post("/v1/chat/completions", json=chat_body(), headers=user)
        ).status == 200
    resp = await client.get("/admin/usage?group_by=day&tenant=acme&since=1h", headers=ADMIN)
    (row,) = (await resp.json())["data"]
    assert {
        k: row[k] for k in ("tenant", "model", "runs", "prompt_tokens", "generated_tokens")
    } == {
        "tenant": "acme",
        "model": "scripted",
        "runs": 3,
        "prompt_tokens": 9,
        "generated_tokens": 6,
    }
    assert len(row["day"]) == 10 and row["total_tokens"] == 15
    assert row["cost"] == pytest.approx(3 * (3 * 1.0 + 2 * 2.0))  # 3 runs of 3 + 2 tokens
    other = await client.get("/admin/usage?model=elsewhere", headers=ADMIN)
    assert (await other.json())["data"] == []


async def test_without_a_tenants_file_tenants_cannot_be_edited(aiohttp_client):
    client = await admin_client(aiohttp_client, None)
    resp = await client.post("/admin/tenants", json={"name": "acme"}, headers=ADMIN)
    assert (resp.status, (await error_of(resp))["code"]) == (409, "no_tenants_store")
    audit = await client.get("/admin/audit", headers=ADMIN)
    assert (await audit.json())["data"] == []


async def test_a_tenants_file_that_cannot_be_written_is_a_clear_error(aiohttp_client, tenants_file):
    client = await admin_client(aiohttp_client, tenants_file)
    # what no permission stops root from: the edit's lock file cannot be opened
    (tenants_file.parent / f".{tenants_file.name}.lock").mkdir()
    resp = await client.patch("/admin/tenants/acme", json={"rpm": 5}, headers=ADMIN)
    assert (resp.status, (await error_of(resp))["code"]) == (500, "tenants_not_writable")
    assert tenants_file.read_text() == TENANTS
