"""`sluice worker` flags: environment defaults, flags win, settings validated, clean failure."""

from __future__ import annotations

import argparse

import pytest

from workers.cli import add_worker_arguments, serve
from workers.config import WorkerConfig


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "MODEL",
        "PORT",
        "HOST",
        "DEVICE",
        "DTYPE",
        "MAX_NUM_SEQS",
        "MAX_NUM_BATCHED_TOKENS",
        "BLOCK_SIZE",
        "KV_CACHE_MEMORY",
        "NUM_KV_BLOCKS",
        "MAX_BODY_BYTES",
        "GRAMMAR_TIMEOUT",
        "STEP_TIME_TARGET",
        "SCHEDULING",
    ):
        monkeypatch.delenv(f"SLUICE_{name}", raising=False)


def test_defaults() -> None:
    args = parse(["--port", "9001"])
    assert vars(args) == {
        "model": "default",
        "port": 9001,
        "host": "127.0.0.1",
        "device": "auto",
        "dtype": "auto",
        "max_num_seqs": 32,
        "max_num_batched_tokens": 512,
        "scheduling": "fair",
        "step_time_target": None,  # the device's default (workers.config.STEP_TIME_TARGETS)
        "block_size": 16,
        "kv_cache_memory": "2GiB",
        "num_kv_blocks": None,
        "max_body_bytes": (4 << 20) + (64 << 10) + (1 << 20),  # the default, plus room
        "grammar_timeout": 5.0,
        "speculative": "prompt-lookup",
        "spec_tokens": 6,
    }


def test_every_flag_reads_the_environment_and_flags_win(monkeypatch) -> None:
    monkeypatch.setenv("SLUICE_MODEL", "/models/a")
    monkeypatch.setenv("SLUICE_PORT", "9100")
    monkeypatch.setenv("SLUICE_HOST", "0.0.0.0")
    monkeypatch.setenv("SLUICE_DEVICE", "cpu")
    monkeypatch.setenv("SLUICE_DTYPE", "float32")
    monkeypatch.setenv("SLUICE_MAX_NUM_SEQS", "4")
    monkeypatch.setenv("SLUICE_MAX_NUM_BATCHED_TOKENS", "128")
    monkeypatch.setenv("SLUICE_BLOCK_SIZE", "8")
    monkeypatch.setenv("SLUICE_KV_CACHE_MEMORY", "64MiB")
    monkeypatch.setenv("SLUICE_NUM_KV_BLOCKS", "100")
    monkeypatch.setenv("SLUICE_MAX_BODY_BYTES", "2048")
    monkeypatch.setenv("SLUICE_GRAMMAR_TIMEOUT", "0.5")
    monkeypatch.setenv("SLUICE_STEP_TIME_TARGET", "0.2")
    monkeypatch.setenv("SLUICE_SPECULATIVE", "off")
    monkeypatch.setenv("SLUICE_SPEC_TOKENS", "3")
    monkeypatch.setenv("SLUICE_SCHEDULING", "fcfs")
    assert vars(parse([])) == {
        "model": "/models/a",
        "port": 9100,
        "host": "0.0.0.0",
        "device": "cpu",
        "dtype": "float32",
        "max_num_seqs": 4,
        "max_num_batched_tokens": 128,
        "scheduling": "fcfs",
        "step_time_target": 0.2,
        "block_size": 8,
        "kv_cache_memory": "64MiB",
        "num_kv_blocks": 100,
        "max_body_bytes": 2048,
        "grammar_timeout": 0.5,
        "speculative": "off",
        "spec_tokens": 3,
    }
    assert parse(["--port", "9200", "--max-num-seqs", "8"]).port == 9200
    assert parse(["--max-num-seqs", "8"]).max_num_seqs == 8


def test_port_is_required_without_the_environment() -> None:
    with pytest.raises(SystemExit):
        parse([])


def test_bad_choices_are_refused() -> None:
    with pytest.raises(SystemExit):
        parse(["--port", "1", "--dtype", "int4"])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"port": 70000},
        {"device": "tpu"},
        {"dtype": "int8"},
        {"max_num_seqs": 0},
        {"block_size": 0},
        {"max_num_batched_tokens": 0},
        {"num_kv_blocks": 0},
        {"speculative": "medusa"},
        {"spec_tokens": 0},
        {"kv_cache_memory": "lots"},
        {"max_body_bytes": 0},
        {"grammar_timeout_s": 0},
        {"step_time_target_s": -0.1},
    ],
)
def test_config_validation(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        WorkerConfig(**kwargs)


async def test_a_model_that_cannot_load_exits_non_zero(tmp_path) -> None:
    assert await serve(WorkerConfig(model=str(tmp_path / "missing"), port=0)) == 1
