"""The public API answers as its OpenAPI document (`/openapi.json`) says: schemathesis generates
requests for every operation from the document, valid and invalid, and checks each answer: never
a 5xx, a status the document lists, a content type and a body of the documented shape.

A real `sluice serve` in front of the scripted OpenAI-compatible upstream, which ends every
completion at 8 tokens (schemathesis reads whole bodies, so streams must end quickly). Half the
chat requests name the served model, so they run."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from gateway.backends.local_worker import free_port
from policies.tenants_file import create_key
from testkit.scripted_upstream import EMBEDDING_SIZE
from tests.support.processes import stop, wait_ready
from tests.support.worker_process import REPO

ADMIN_KEY = "sk-admin-contract-0123456789"
# every tier allowed: a generated request may ask for any of them (a tier the tenant may not
# use is a 400 for valid data, which the contract check would count against the document)
TENANTS = """\
[tenants.contract]
tiers = ["priority", "default", "flex"]
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[str, str]]:
    tmp = tmp_path_factory.mktemp("openapi")
    tenants = tmp / "tenants.toml"
    tenants.write_text(TENANTS)
    key = create_key(tenants, "contract")[0]
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLUICE_LOG_LEVEL": "error"}
    up_port, port = free_port(), free_port()
    upstream = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "testkit.scripted_upstream",
            "--port",
            str(up_port),
            "--max-tokens",
            "8",
        ],
        cwd=REPO,
        env=env,
    )
    command = [
        *(sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)),
        *("--upstream", f"scripted=http://127.0.0.1:{up_port}/v1", "--tenants", str(tenants)),
        *("--usage-file", str(tmp / "usage.jsonl")),
        *("--admin-key", ADMIN_KEY),
    ]
    gateway = subprocess.Popen(command, cwd=REPO, env=env)
    try:
        wait_ready(gateway, f"http://127.0.0.1:{port}/readyz")
        yield f"http://127.0.0.1:{port}", key
    finally:
        stop(gateway)
        stop(upstream)


@pytest.fixture(scope="module")
def api_schema(served):
    root, _ = served
    return schemathesis.openapi.from_url(f"{root}/openapi.json")


def test_the_document_is_served_without_a_credential_and_names_every_route(served):
    root, _ = served
    document = httpx.get(f"{root}/openapi.json").json()
    assert document["openapi"] == "3.1.0"
    assert set(document["paths"]) == {
        "/v1/chat/completions",
        "/v1/chat/completions/{id}",
        "/v1/chat/completions/{id}/cancel",
        "/v1/completions",
        "/v1/completions/{id}",
        "/v1/completions/{id}/cancel",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/responses/{id}",
        "/v1/responses/{id}/cancel",
        "/v1/responses/{id}/input_items",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/models",
        "/v1/models/{model}",
        "/healthz",
        "/readyz",
        "/metrics",
        "/openapi.json",
        "/admin/tenants",
        "/admin/tenants/{name}",
        "/admin/tenants/{name}/keys",
        "/admin/keys/{key_id}",
        "/admin/usage",
        "/admin/audit",
    }


# per operation; a longer hunt: SLUICE_CONTRACT_EXAMPLES=500
EXAMPLES = int(os.environ.get("SLUICE_CONTRACT_EXAMPLES", "30"))
OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/chat/completions/{id}"),
    ("POST", "/v1/chat/completions/{id}/cancel"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/completions/{id}"),
    ("POST", "/v1/completions/{id}/cancel"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{id}"),
    ("POST", "/v1/responses/{id}/cancel"),
    ("DELETE", "/v1/responses/{id}"),
    ("GET", "/v1/responses/{id}/input_items"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model}"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("GET", "/admin/tenants"),
    ("POST", "/admin/tenants"),
    ("GET", "/admin/tenants/{name}"),
    ("PATCH", "/admin/tenants/{name}"),
    ("DELETE", "/admin/tenants/{name}"),
    ("POST", "/admin/tenants/{name}/keys"),
    ("DELETE", "/admin/keys/{key_id}"),
    ("GET", "/admin/usage"),
    ("GET", "/admin/audit"),
]


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_every_answer_matches_the_document(api_schema, served, method, path):
    root, key = served
    operation = api_schema[path][method]
    calls = []
    # NOTE: what no JSON schema says exactly: a tenant's fields constrain one another
    # (`default_tier` among `tiers`, a budget's two halves, `safety` naming a defined policy),
    # and `since` is a duration or any ISO-8601 time (a real date). There a schema-valid value
    # may be a 400 naming it, so these operations are not held to accepting every valid request
    loose = {
        ("POST", "/admin/tenants"),
        ("PATCH", "/admin/tenants/{name}"),
        ("GET", "/admin/usage"),
        ("GET", "/admin/audit"),
    }
    excluded = [positive_data_acceptance] if (method, path) in loose else []

    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    def answers_as_documented(case) -> None:
        body = case.body
        creates = (
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/responses",
            "/v1/messages",
            "/v1/embeddings",
        )
        if path in creates and isinstance(body, dict) and len(calls) % 2:
            body["model"] = "scripted"  # half of them reach the upstream
            if isinstance(body.get("metadata"), dict):  # the scripted upstream's own knob
                body["metadata"].pop("delay_ms", None)
            if isinstance(body.get("dimensions"), int | float):  # a model's size: no schema's
                body["dimensions"] = min(body["dimensions"], EMBEDDING_SIZE)
        credential = ADMIN_KEY if path.startswith("/admin/") else key
        headers = {"Authorization": f"Bearer {credential}"}
        if case.headers and "Idempotency-Key" in case.headers:
            # a reused key is refused for the history behind it (422), not the request's shape
            case.headers["Idempotency-Key"] = uuid.uuid4().hex
        calls.append(
            case.call_and_validate(
                base_url=root, headers=headers, timeout=30, excluded_checks=excluded
            )
        )

    answers_as_documented()
    assert calls, "schemathesis generated no request"
