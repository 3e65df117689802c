"""Prices in the config file, and what a usage record costs at them."""

from __future__ import annotations

import orjson
import pytest

from common.config import ConfigError
from gateway.prices import Price, unserved
from gateway.runs.accounting import usage_record
from gateway.runs.spec import RunOutcome
from gateway.runs.status import RunStatus
from gateway.settings import load_settings
from gateway.state.ledger import UsageRecord
from gateway.state.run_store import TerminalRecord

PRICED = """
[prices."tiny"]
input_per_million = 0.15
output_per_million = 0.60

[prices."embed"]
input_per_million = 0.02
"""


def settings_from(tmp_path, text: str):
    path = tmp_path / "sluice.toml"
    path.write_text(text)
    return load_settings({"config": str(path)}, environ={})


def test_prices_come_from_the_config_file(tmp_path):
    prices = settings_from(tmp_path, PRICED).price_table()
    assert prices == {
        "tiny": Price(input_per_million=0.15, output_per_million=0.6),
        "embed": Price(input_per_million=0.02, output_per_million=0.0),
    }


@pytest.mark.parametrize(
    ("table", "named"),
    [
        ("input = 0.15", "unknown key 'input'; a price takes input_per_million and output"),
        ("input_per_million = -0.15", "input_per_million must be a finite number >= 0"),
        ('output_per_million = "0.60"', "output_per_million must be a number"),
        ("", "sets no price"),
    ],
)
def test_a_bad_price_fails_the_start_naming_its_model_and_key(tmp_path, table, named):
    with pytest.raises(ConfigError) as info:
        settings_from(tmp_path, f'[prices."tiny"]\n{table}\n')
    assert '[prices."tiny"]' in str(info.value) and named in str(info.value)


def test_a_price_for_a_model_nobody_serves_is_only_reported():
    prices = {"tiny": Price(1.0), "gone": Price(1.0)}
    assert unserved(prices, ["tiny", "other"]) == ["gone"]


def outcome(prompt: int | None, generated: int, tail: int, model: str = "tiny") -> RunOutcome:
    return RunOutcome(
        run_id="run-1",
        tenant="acme",
        principal="key_1",
        model=model,
        terminal=TerminalRecord(RunStatus.CANCELLED, "cancel:client"),
        cancel_source="client",
        cancel_outcome="tail",
        cancel_latency_ms=3.0,
        prompt_tokens=prompt,
        generated_tokens=generated,
        sent_tokens=generated - tail,
        tail_tokens=tail,
        upstream_tail_tokens=tail,
        upstream_stop_ms=1.0,
        ttft_s=0.01,
        e2e_s=0.5,
        tail_latency_s=0.001,
    )


def test_a_records_cost_is_its_tokens_at_the_price_the_tail_included():
    price = Price(input_per_million=0.15, output_per_million=0.60)
    record = usage_record(outcome(prompt=1000, generated=500, tail=20), price)
    assert record.cost == pytest.approx((1000 * 0.15 + 500 * 0.60) / 1e6)
    assert record.cost == 0.00045  # exactly: no float noise reaches the record
    assert usage_record(outcome(1000, 500, 20), None).cost is None  # no price, no cost


def test_a_record_written_before_cost_existed_reads_as_unpriced():
    record = usage_record(outcome(10, 5, 0), Price(1.0, 2.0))
    old = orjson.loads(record.to_json())
    del old["cost"]
    assert UsageRecord.from_json(orjson.dumps(old)).cost is None
    assert UsageRecord.from_json(record.to_json()) == record
