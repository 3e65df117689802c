"""sluicegate observed the way a platform team runs it, proven against a real Prometheus.

deploy/prometheus's config and rules pass promtool (its rule unit tests included); every alert
has a runbook page on the docs site (docs/operations/runbooks/). Then a real `sluice serve`
with its worker on the tiny model takes a short load (streams, a client cancel, a disconnect, a
resume, a 429, 4xx and 5xx answers), a real `prometheus` scrapes both with deploy/prometheus's
own jobs and rules, and every PromQL expression of the Grafana dashboard and of the rules
returns data: the names, labels and label values they select on are the ones sluicegate
exports. The same scrapes prove design §7's names and labels, and that clients cannot mint
label values (an unknown model is `unknown`)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.backends.local_worker import free_port
from gateway.metric_labels import KNOWN, RUNTIME, combinations
from policies.tenants_file import create_key
from tests.support.metric_names import GATEWAY_METRICS, WORKER_METRICS
from tests.support.metrics import scraped
from tests.support.processes import stop, wait_ready
from tests.support.prometheus import (
    DEPLOY,
    Prometheus,
    alert_bases,
    alert_rules,
    config_for,
    dashboard_queries,
    load_yaml,
    promtool,
    recording_rules,
    running_prometheus,
)
from tests.support.redis_server import PrivateRedis
from tests.support.serve import local_worker_url, serving
from tests.support.waiting import until_sync
from tests.support.worker_process import REPO

DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "sluicegate.json"
TENANTS = """\
[tenants.open]

[tenants.limited]
rpm = 1
"""
PROMPT = [{"role": "user", "content": "Tell me a long story."}]
LONG = 900  # tokens: a run that is still going when it is cancelled or left


@dataclass
class Gateway:
    """The gateway, its worker, the model they serve and the tenants' keys."""

    root: str
    worker: str
    model: str
    keys: dict[str, str]
    fresh: str  # its /metrics before any request


@dataclass
class Stack(Gateway):
    """… and the Prometheus scraping them."""

    prometheus: Prometheus


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat(stack: Gateway, tenant: str = "open", **body) -> httpx.Response:
    body = {"model": stack.model, "messages": PROMPT, "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(
        f"{stack.root}/v1/chat/completions", json=body, headers=auth(stack.keys[tenant]), timeout=30
    )


def sse_events(response: httpx.Response) -> Iterator[tuple[int, dict]]:
    """(event id, chunk) of each `id:`/`data:` pair of a stream, until `[DONE]`."""
    event_id = 0
    for line in response.iter_lines():
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            if line == "data: [DONE]":
                return
            yield event_id, orjson.loads(line[6:])


def open_stream(client: httpx.Client, stack: Gateway, **body) -> AbstractContextManager:
    body = {"model": stack.model, "messages": PROMPT, "stream": True, "temperature": 0, **body}
    return client.stream(
        "POST", f"{stack.root}/v1/chat/completions", json=body, headers=auth(stack.keys["open"])
    )


def decoding(events: Iterator[tuple[int, dict]]) -> str:
    """The run id, once the stream's first text came: the run is decoding."""
    for _, chunk in events:
        if any(c["delta"].get("content") for c in chunk.get("choices", [])):
            return chunk["id"]
    raise AssertionError("the stream ended before any text")


def run_status(stack: Gateway, run_id: str) -> str:
    url = f"{stack.root}/v1/chat/completions/{run_id}"
    return httpx.get(url, headers=auth(stack.keys["open"]), timeout=10).json()["status"]


def warm_up(stack: Gateway) -> None:
    """The first of some answers, before Prometheus first scrapes: a labelled series exists only
    once counted, and `rate()` cannot see the count a series is born with, so these make the
    load's own 200s, 429 and 503 visible as rates."""
    assert chat(stack).status_code == 200
    assert chat(stack, "limited").status_code == 200
    assert chat(stack, "limited").status_code == 429
    assert chat(stack, model="dead").status_code == 503


def generate_load(stack: Gateway) -> None:
    """What production traffic does to the series the dashboard and the rules read."""
    with httpx.Client(timeout=30) as client:
        for _ in range(3):  # streams that complete
            with open_stream(client, stack, max_tokens=8) as response:
                assert response.status_code == 200
                assert list(sse_events(response))
        with open_stream(client, stack, max_tokens=LONG) as response:  # a client's cancel
            run_id = decoding(sse_events(response))
            url = f"{stack.root}/v1/chat/completions/{run_id}/cancel"
            cancelled = client.post(url, headers=auth(stack.keys["open"]))
            assert cancelled.json()["status"] == "cancelled"
        with open_stream(client, stack, max_tokens=LONG) as response:  # a client that leaves
            left = decoding(sse_events(response))
        with open_stream(client, stack, max_tokens=8) as response:  # a resume of an ended run
            events = list(sse_events(response))
        run_id = events[0][1]["id"]
        url = f"{stack.root}/v1/chat/completions/{run_id}"
        params = {"stream": "true", "starting_after": str(events[1][0])}
        with client.stream("GET", url, params=params, headers=auth(stack.keys["open"])) as resumed:
            assert resumed.status_code == 200
            assert [i for i, _ in sse_events(resumed)] == [i for i, _ in events[2:]]
    assert chat(stack, "limited").status_code == 429  # rpm = 1, spent by the warm-up
    assert chat(stack, model="nope-123").status_code == 404  # a model nobody serves
    assert chat(stack, max_tokens=-1).status_code == 400
    assert chat(stack, model="dead").status_code == 503  # its only backend never answers
    bad_key = httpx.post(f"{stack.root}/v1/chat/completions", json={}, headers=auth("sk-nobody"))
    assert bad_key.status_code == 401
    until_sync(lambda: run_status(stack, left) == "cancelled", "the disconnect's grace to end")


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory) -> Iterator[Stack]:
    """`sluice serve` on the tiny model (plus an upstream that never answers, for 503s), a
    real Prometheus scraping it and its worker, and the load, done once the Prometheus has
    scraped it."""
    tmp = tmp_path_factory.mktemp("observability")
    tenants = tmp / "tenants.toml"
    tenants.write_text(TENANTS)
    keys = {name: create_key(tenants, name)[0] for name in ("open", "limited")}
    port = free_port()
    command = [
        *(sys.executable, "-m", "gateway.cli", "serve", "--model", str(tiny_model_dir)),
        *("--dtype", "float32", "--device", "cpu", "--tenants", str(tenants)),
        *("--port", str(port), "--disconnect-grace", "0.5"),
        *("--upstream", f"dead=http://127.0.0.1:{free_port()}/v1"),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLUICE_LOG_LEVEL": "warning"}
    env.setdefault("SLUICE_SHUTDOWN_TIMEOUT", "2")
    proc = subprocess.Popen(command, cwd=REPO, env=env)
    try:
        root = f"http://127.0.0.1:{port}"
        wait_ready(proc, f"{root}/readyz")
        fresh = httpx.get(f"{root}/metrics", timeout=5).text
        worker = local_worker_url(root)
        models = httpx.get(f"{root}/v1/models", headers=auth(keys["open"])).json()["data"]
        (model,) = [m["id"] for m in models if m["id"] != "dead"]
        config = config_for([f"127.0.0.1:{port}"], [worker.removeprefix("http://")])
        gateway = Gateway(root, worker, model, keys, fresh)
        warm_up(gateway)
        with running_prometheus(tmp, config) as prometheus:
            stack = Stack(**vars(gateway), prometheus=prometheus)
            until_sync(lambda: prometheus.value("sum(up)") == 2, "both targets scraped")
            generate_load(stack)
            until_sync(lambda: scraped_everything(stack), "prometheus to scrape the load")
            yield stack
    finally:
        stop(proc)


def scraped_everything(stack: Stack) -> bool:
    """Whether Prometheus holds what the gateway counts now (nothing moves after the load), in
    at least two samples of every series: `rate()` has nothing to say about a series it has
    seen once, as one born in the last scrape before the queries would be."""
    for name in (
        "sluice_requests_total",
        "sluice_cancellations_total",
        "sluice_resumes_total",
        "sluice_tenant_tokens_served_total",
    ):
        if stack.prometheus.value(f"sum({name})") != scraped(stack.root, name):
            return False
        seen_twice = f"count(count_over_time({name}[5m]) >= 2)"
        if stack.prometheus.value(seen_twice) != stack.prometheus.value(f"count({name})"):
            return False
    return True


def numbers(result: list[dict]) -> list[float]:
    return [float(sample["value"][1]) for sample in result]


# --- the files, checked by promtool ----------------------------------------------------------


@pytest.mark.process
@pytest.mark.parametrize(
    "args",
    [
        ("check", "config", "deploy/prometheus/prometheus.yml"),
        ("check", "rules", "deploy/prometheus/alerts.yml"),
        ("test", "rules", "deploy/prometheus/alerts_test.yml"),
    ],
    ids=["check-config", "check-rules", "test-rules"],
)
def test_promtool_passes_the_deployed_config_and_rules(args):
    done = promtool(*args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def nav_pages(nav: object) -> set[str]:
    """Every page the docs site's nav (mkdocs.yml) lists, as paths under docs/."""
    if isinstance(nav, str):
        return {nav}
    items = nav.values() if isinstance(nav, dict) else nav
    return set().union(*(nav_pages(item) for item in items))


def test_every_alert_has_a_summary_a_description_and_a_runbook_page():
    listed = nav_pages(load_yaml(REPO / "mkdocs.yml")["nav"])
    overview = (REPO / "docs/operations/alerts.md").read_text()
    rules = alert_rules()
    assert len(rules) >= 8
    for rule in rules:
        name, notes = rule["alert"], rule["annotations"]
        assert notes["summary"] and notes["description"], name
        page = f"operations/runbooks/{name.lower()}.md"
        assert notes["runbook"] == f"docs/{page}", name
        assert (REPO / "docs" / page).read_text().startswith(f"# {name}\n"), name
        assert page in listed, name  # in the site's nav, so `mkdocs build --strict` builds it
        assert f"(runbooks/{name.lower()}.md)" in overview, name  # and linked from Alerts
        alert_bases(rule["expr"])  # `<base> <comparison> <number>`, or two joined by `and on`


def test_every_alert_has_a_unit_test_that_fires_it_and_one_that_does_not():
    cases = [case for group in promtool_tests() for case in group["alert_rule_test"]]
    fired = {case["alertname"] for case in cases if case["exp_alerts"]}
    silent = {case["alertname"] for case in cases if not case["exp_alerts"]}
    names = {rule["alert"] for rule in alert_rules()}
    assert fired == names and silent == names


def promtool_tests() -> list[dict]:
    return load_yaml(DEPLOY / "alerts_test.yml")["tests"]


# --- a real gateway, worker and Prometheus ---------------------------------------------------


def families(url: str) -> dict[str, object]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_every_contract_metric_is_exported_with_its_labels(stack):
    exported = families(stack.root)
    for name, (kind, labels) in GATEWAY_METRICS.items():
        family = exported.get(name)
        assert family is not None, name
        assert family.type == kind, name
        assert family.samples, f"{name} has no series after the load"
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == labels, (name, sample.labels)
    worker = families(stack.worker)
    assert set(worker) >= WORKER_METRICS
    preemptions = worker["sluice_worker_preemptions"].samples
    assert {s.labels["reason"] for s in preemptions} == {"kv", "fairness", "priority"}


def test_a_fresh_gateway_exports_every_known_series_at_zero(stack):
    """Every combination of gateway/metric_labels.py's table, for each value of a run-time
    label the process knew at start (its models, its tenants, its local worker and pools), is
    there at 0 before the first request: `rate()` and `increase()` see a series' first event."""
    fresh = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(stack.fresh)
        for s in family.samples
        if s.name.endswith("_total")
    }

    def named(name: str, label: str) -> set[str]:
        return {dict(labels)[label] for n, labels in fresh if n == name}

    started = {
        "model": {stack.model, "dead"},
        "tenant": {"open", "limited"},
        "alias": set(),  # none configured
        "pool": named("sluice_run_migrations_total", "pool"),
    }
    workers = named("sluice_local_worker_restarts_total", "member")
    members = named("sluice_member_requests_total", "member")
    assert len(workers) == 1 and started["pool"] and members  # its worker, in a pool
    missing = []
    for family, row in KNOWN.items():
        label = RUNTIME.get(family)
        if family == "sluice_member_ejections":
            values = members
        elif family == "sluice_local_worker_restarts":
            values = workers
        else:
            values = started[label] if label else {None}
        for value in values:
            for combo in combinations(row):
                labels = dict(zip(row, combo, strict=True))
                if label is not None:
                    labels[label] = value
                count = fresh.get((f"{family}_total", frozenset(labels.items())))
                # NOTE: the pool's first probe found the `dead` upstream down before any request
                if count is None or (count and family != "sluice_member_ejections"):
                    missing.append((family, labels))
    assert missing == []


def bounds(family) -> list[float]:
    return sorted(float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket"))


def test_latency_buckets_span_milliseconds_to_minutes(stack):
    exported = families(stack.root)
    for name, longest in [
        ("sluice_ttft_seconds", 600),
        ("sluice_e2e_seconds", 600),
        ("sluice_inter_token_seconds", 60),
        ("sluice_cancel_latency_seconds", 60),
    ]:
        le = bounds(exported[name])
        assert le[0] <= 0.001 and le[-2] >= longest, (name, le)  # le[-1] is +Inf
    step = bounds(families(stack.worker)["sluice_worker_step_seconds"])
    assert step[0] <= 0.001 and step[-2] >= 10


def test_clients_cannot_mint_label_values(stack):
    samples = [
        s for s in families(stack.root)["sluice_requests"].samples if s.name.endswith("_total")
    ]
    assert {s.labels["model"] for s in samples} == {stack.model, "dead", "unknown", ""}
    assert {s.labels["tenant"] for s in samples} <= {"open", "limited", ""}
    not_found = [s for s in samples if s.labels["code"] == "404"]
    assert [s.labels["model"] for s in not_found] == ["unknown"]
    assert not stack.prometheus.query('sluice_requests_total{model="nope-123"}')
    assert stack.prometheus.query('sluice_requests_total{model="unknown", code="404"}')
    assert stack.prometheus.query('sluice_requests_total{tenant="limited", code="429"}')


def by_labels(family, *names: str) -> dict[tuple[str, ...], float]:
    """A family's value per label values, its `_created` samples left out."""
    return {
        tuple(s.labels[name] for name in names): s.value
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_fair_sharing_series_cover_every_tenant_and_tier_before_anything_waits(stack):
    """Each tenant of the file has its weight, its tokens served and a queue depth for each
    tier it may use (by default `default` and `flex`), and each tier a shed count, exported
    before any run waited or was shed: the Fairness row and SluiceTenantStarved see a tenant
    before its first wait. Nothing waited or was shed under this load."""
    exported = families(stack.root)
    tenants = ("open", "limited")
    depth = by_labels(exported["sluice_flow_queue_depth"], "tenant", "tier")
    assert depth == {(t, tier): 0 for t in tenants for tier in ("default", "flex")}
    shed = by_labels(exported["sluice_flow_shed"], "tier")
    assert shed == {("priority",): 0, ("default",): 0, ("flex",): 0}
    assert by_labels(exported["sluice_tenant_weight"], "tenant") == {(t,): 1 for t in tenants}
    served = by_labels(exported["sluice_tenant_tokens_served"], "tenant")
    assert served.keys() == {(t,) for t in tenants} and served[("open",)] > 0


def test_every_dashboard_query_returns_data(stack):
    dashboard = orjson.loads(DASHBOARD.read_bytes())
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 20
    empty = [(title, expr) for title, expr in queries if not stack.prometheus.query(expr)]
    assert not empty
    # a number, not NaN, where the load made one: the cost of a completed run among them
    (cost,) = [expr for title, expr in queries if title == "Generated tokens per completed run"]
    values = numbers(stack.prometheus.query(cost))
    assert values and all(value > 0 and math.isfinite(value) for value in values), values


def test_every_rule_is_evaluated_and_every_alert_base_returns_data(stack):
    prometheus = stack.prometheus
    for rule in recording_rules():
        assert prometheus.query(rule["expr"]), rule["record"]
        until_sync(lambda rule=rule: prometheus.query(rule["record"]), rule["record"], within=10)
    for rule in alert_rules():
        for base in alert_bases(rule["expr"]):
            assert prometheus.query(base), (rule["alert"], base)
    # what the load moved, as the alerts see it
    assert 0 < prometheus.value("job:sluice_ttft_seconds:p95_rate5m") < 5
    assert 0 < prometheus.value("job:sluice_requests_5xx:ratio_rate5m") < 1
    assert prometheus.value("job:sluice_cancel_tail_tokens:mean_rate15m") >= 0
    # nothing waits once the load is done; `open`, the only tenant served in the window, got
    # all the tokens and is the only one competing: exactly its weighted share
    assert prometheus.value("sum(tenant:sluice_flow_queue_depth:sum)") == 0
    shares = prometheus.query("tenant:sluice_tenant_tokens_served:fair_share_ratio_rate5m")
    assert [(s["metric"]["tenant"], float(s["value"][1])) for s in shares] == [("open", 1.0)]
    loaded = prometheus.rules()
    assert {r["name"] for r in loaded} == {
        *(r["record"] for r in recording_rules()),
        *(r["alert"] for r in alert_rules()),
    }
    assert all(r["health"] == "ok" for r in loaded), [r for r in loaded if r["health"] != "ok"]


# --- Redis answering, as a gauge ---------------------------------------------------------------


@pytest.fixture
def private_redis(tmp_path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


def test_store_up_follows_redis(scripted_upstream, private_redis):
    """`sluice_store_up` (SluiceStoreDown's series) drops when Redis goes and comes back with
    it, with no request needed: the owner lease's renewal asks Redis all the time."""
    flags = ("--upstream", f"scripted={scripted_upstream}", "--redis-url", private_redis.url)
    with serving(None, *flags, env={"SLUICE_LEASE_TTL": "1"}) as served:
        assert scraped(served.root, "sluice_store_up") == 1
        private_redis.kill()
        until_sync(lambda: scraped(served.root, "sluice_store_up") == 0, "store_up 0")
        private_redis.start()
        until_sync(lambda: scraped(served.root, "sluice_store_up") == 1, "store_up 1")


def test_store_up_is_one_with_the_in_process_store(stack):
    assert scraped(stack.root, "sluice_store_up") == 1
    assert numbers(stack.prometheus.query("sluice_store_up")) == [1.0]
