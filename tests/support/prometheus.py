"""A real `prometheus` process for tests: deploy/prometheus's own configuration, pointed at the
processes under test, scraping every second, on a free port with its storage in a temp dir."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import yaml

from gateway.backends.local_worker import free_port
from tests.support.processes import stop
from tests.support.waiting import until_sync
from tests.support.worker_process import REPO

DEPLOY = REPO / "deploy" / "prometheus"
CONFIG = DEPLOY / "prometheus.yml"
RULES = DEPLOY / "alerts.yml"
# Grafana's own variables, as a dashboard's queries use them, and what a test puts in their
# place: a window that spans the whole test, so every rate sees all of its samples.
GRAFANA_WINDOWS = ("$__rate_interval", "$__interval", "$__range")
TEST_WINDOW = "5m"
# `<base> <comparison> <number>`, the shape of every alert in alerts.yml (or of each of two
# such conditions joined by `and on (labels)`)
ALERT_SHAPE = re.compile(r"^(?P<base>.+?)\s*(?:>=|<=|==|!=|>|<)\s*(?P<threshold>[-+.\deE]+)$", re.S)
CONJUNCTION = re.compile(r"\s+and\s+on\s*\([\w\s,]*\)\s+")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    """`promtool ARGS…` from the repository root, its output kept for the assertion message."""
    binary = shutil.which("promtool")
    assert binary, "promtool is not installed (Debian: apt-get install prometheus)"
    return subprocess.run([binary, *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def alert_rules() -> list[dict]:
    return [
        rule for group in load_yaml(RULES)["groups"] for rule in group["rules"] if "alert" in rule
    ]


def recording_rules() -> list[dict]:
    return [
        rule for group in load_yaml(RULES)["groups"] for rule in group["rules"] if "record" in rule
    ]


def alert_bases(expr: str) -> list[str]:
    """An alert's expressions without their threshold comparisons: one for `<base> <comparison>
    <number>`, one per condition where conditions are joined by `and on (labels)`."""
    bases = []
    for condition in CONJUNCTION.split(expr.strip()):
        shape = ALERT_SHAPE.match(condition)
        assert shape, f"not `<base> <comparison> <number>`: {condition}"
        bases.append(shape["base"])
    return bases


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel, Grafana's windows filled in."""
    queries = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable in GRAFANA_WINDOWS:
                expr = expr.replace(variable, TEST_WINDOW)
            queries.append((panel["title"], expr))
    return queries


def config_for(gateways: list[str], workers: list[str]) -> dict:
    """deploy/prometheus/prometheus.yml with its job names, its rule file (by absolute path)
    and these targets (host:port), scraped and evaluated every second."""
    config = load_yaml(CONFIG)
    config["global"] = {
        "scrape_interval": "1s",
        "scrape_timeout": "1s",
        "evaluation_interval": "1s",
    }
    config["rule_files"] = [str(RULES)]
    targets = {"sluice-gateway": gateways, "sluice-worker": workers}
    config["scrape_configs"] = [
        {**job, "static_configs": [{"targets": targets[job["job_name"]]}]}
        for job in config["scrape_configs"]
    ]
    return config


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, promql: str) -> list[dict]:
        """The result of an instant query (a scalar as a one-sample list); a failed query fails
        the test with Prometheus's own error."""
        answer = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10).json()
        assert answer["status"] == "success", f"{promql}: {answer.get('error')}"
        data = answer["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def value(self, promql: str) -> float:
        """A one-sample query's value (NaN when it has none)."""
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else math.nan

    def rules(self) -> list[dict]:
        answer = httpx.get(f"{self.url}/api/v1/rules", timeout=10).json()
        return [rule for group in answer["data"]["groups"] for rule in group["rules"]]


@contextmanager
def running_prometheus(tmp: Path, config: dict) -> Iterator[Prometheus]:
    """`prometheus` with `config` until the block ends."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed (Debian: apt-get install prometheus)"
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    log = tmp / "prometheus.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={path}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, log.read_text()
        try:
            return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        until_sync(ready, "prometheus to be ready", within=30)
        yield Prometheus(url)
    finally:
        stop(proc)
