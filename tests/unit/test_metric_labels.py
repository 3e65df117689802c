"""The table of known label values (gateway/metric_labels.py): every series it names is exported
at 0 by a fresh gateway's registry, and the code counts no label value the table lacks."""

from __future__ import annotations

import ast
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from adapters.events import FINISH_REASONS
from adapters.pool import PoolAdapter
from adapters.retry_budget import RetryBudget
from gateway.backends.pool_metrics import PoolCollector, RetryCollector
from gateway.metric_labels import (
    CANCEL_OUTCOMES,
    CANCEL_SOURCES,
    DEADLINES,
    KNOWN,
    RUN_END_REASONS,
    RUNTIME,
    combinations,
)
from gateway.metrics import GatewayMetrics
from gateway.runs import accounting, endings
from policies.tenants import parse_text
from tests.unit.test_pool import Member

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [
    p for d in ("gateway", "adapters", "policies", "safety") for p in (ROOT / d).rglob("*.py")
]

# the attribute (or local) names code counts through → their family in the table
COUNTERS = {
    "runs_finished": "sluice_runs_finished",
    "tokens": "sluice_tokens",
    "deadlines": "sluice_deadlines_exceeded",
    "cancellations": "sluice_cancellations",
    "resumes": "sluice_resumes",
    "quota_rejections": "sluice_quota_rejections",
    "shed": "sluice_flow_shed",
    "early_upstreams": "sluice_early_upstreams",
    "fallbacks": "sluice_fallbacks",
}

TENANTS = """
[tenants.acme]
rpm = 10
"""


def fresh_samples() -> dict[tuple[str, frozenset], float]:
    """Every sample of a gateway that knows one model, tenant, alias, local worker and pool."""
    metrics = GatewayMetrics()
    metrics.know_models(["tiny"])
    metrics.know_tenants(parse_text(TENANTS, Path("tenants.toml")).tenants.values())
    metrics.know_aliases(["fast"])
    metrics.know_workers(["worker-0"])
    metrics.registry.register(RetryCollector(RetryBudget()))
    metrics.registry.register(PoolCollector([PoolAdapter([Member("a")], name="tiny")]))
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_every_known_series_is_exported_at_zero_from_the_start():
    samples = fresh_samples()
    started = {"model": "tiny", "tenant": "acme", "alias": "fast", "member": "a", "pool": "tiny"}
    started_by_family = {"sluice_local_worker_restarts": "worker-0"}
    missing = []
    for family, row in KNOWN.items():
        labels = {}
        if (label := RUNTIME.get(family)) is not None:
            labels[label] = started_by_family.get(family, started[label])
        for combo in combinations(row):
            series = frozenset({**labels, **dict(zip(row, combo, strict=True))}.items())
            if samples.get((f"{family}_total", series)) != 0:
                missing.append((family, dict(series)))
    assert missing == []


def test_the_overhead_histogram_has_both_phases_from_the_start():
    samples = fresh_samples()
    for phase in ("request", "chunk"):
        assert (
            samples[("sluice_gateway_overhead_seconds_count", frozenset({("phase", phase)}))] == 0
        )


def test_the_codes_own_constants_are_the_tables():
    assert set(FINISH_REASONS) | set(accounting._END_REASON.values()) <= set(RUN_END_REASONS)
    assert {c.removeprefix("deadline:") for c in endings._DEADLINES} == set(DEADLINES)
    assert endings.SHUTDOWN in CANCEL_SOURCES
    tree = ast.parse(Path(accounting.__file__).read_text())
    outcomes = {
        c.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "cancel_outcome" for t in node.targets)
        for c in _strings(node.value)
    }
    assert outcomes == set(CANCEL_OUTCOMES)


def literal_label_values() -> list[tuple[str, str, int, str]]:
    """(file:line, family, position, value) for each string literal the code counts a table
    family under: in a `.labels(...)` call, or assigned to the local variable it passes there."""
    found = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            assigned: dict[str, list[ast.Constant]] = {}
            for node in ast.walk(func):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            assigned.setdefault(target.id, []).extend(_strings(node.value))
            for node in ast.walk(func):
                family = _counted_family(node)
                if family is None:
                    continue
                for position, arg in enumerate(node.args):
                    values = (
                        _strings(arg) if not isinstance(arg, ast.Name) else assigned.get(arg.id, [])
                    )
                    for const in values:
                        where = f"{path.relative_to(ROOT)}:{const.lineno}"
                        found.append((where, family, position, const.value))
    return found


def _counted_family(node: ast.AST) -> str | None:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    if node.func.attr != "labels":
        return None
    receiver = node.func.value
    name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", None)
    return COUNTERS.get(name)


def _strings(expr: ast.AST) -> list[ast.Constant]:
    """The string literals an expression can evaluate to (not those it merely uses)."""
    if isinstance(expr, ast.Constant):
        return [expr] if isinstance(expr.value, str) else []
    if isinstance(expr, ast.IfExp):
        return _strings(expr.body) + _strings(expr.orelse)
    if isinstance(expr, ast.BoolOp):
        return [c for value in expr.values for c in _strings(value)]
    return []


def test_no_literal_label_value_is_missing_from_the_table():
    found = literal_label_values()
    assert len(found) > 5  # the scan sees the code's counting
    unknown = []
    for where, family, position, value in found:
        row = KNOWN[family]
        runtime = {"sluice_runs_finished": 1, "sluice_fallbacks": 1}.get(family, 0)
        if position < runtime:
            continue  # the model or alias: only known at run time
        values = list(row.values())[position - runtime]
        if value not in values:
            unknown.append((where, family, value))
    assert unknown == []


def test_every_literal_cancel_source_is_in_the_table():
    """Sources reach the counter through `cancel(...)`, `cancel_here(...)`, `stop(...)` and a
    stage's `stop_source`: the literals passed there."""
    unknown = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            values: list[ast.Constant] = []
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                attr, args = node.func.attr, node.args
                if attr in ("cancel", "cancel_here", "signal_cancel") and len(args) == 2:
                    values = _strings(args[1])
                elif attr == "cancel" and len(args) == 1:
                    values = _strings(args[0])
                elif attr == "stop" and len(args) >= 3:
                    values = _strings(args[2])
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Attribute) and t.attr == "stop_source" for t in node.targets
            ):
                values = _strings(node.value)
            unknown += [(str(path), c.value) for c in values if c.value not in CANCEL_SOURCES]
    assert unknown == []


def test_a_registry_can_hold_two_gateways():
    """Each app owns its registry: a second one starts from 0 too."""
    first, second = GatewayMetrics(), GatewayMetrics(CollectorRegistry())
    first.resumes.labels("live").inc()
    assert second.registry.get_sample_value("sluice_resumes_total", {"outcome": "live"}) == 0
