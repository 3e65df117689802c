"""`sluice worker` settings: flags win over `SLUICE_<FLAG>` variables, which win over the
`--config` file, which wins over the defaults; settings validated, clean failure."""

from __future__ import annotations

import pytest

from common.config import ConfigError
from common.worker_settings import load_worker_config
from workers.cli import main, serve
from workers.config import WorkerConfig


def load(argv: list[str], env: dict[str, str] | None = None) -> WorkerConfig:
    return load_worker_config(argv, env or {})


def test_defaults() -> None:
    assert load(["--port", "9001"]) == WorkerConfig(
        model="default",
        port=9001,
        host="127.0.0.1",
        device="auto",
        dtype="auto",
        max_num_seqs=32,
        max_num_batched_tokens=512,
        scheduling="fair",
        step_time_target_s=None,  # the device's default (workers.config.STEP_TIME_TARGETS)
        block_size=16,
        kv_cache_memory="2GiB",
        num_kv_blocks=None,
        max_body_bytes=(4 << 20) + (64 << 10) + (1 << 20),  # the default, plus room
        grammar_timeout_s=5.0,
        speculative="prompt-lookup",
        spec_tokens=6,
    )


EVERY_VARIABLE = {
    "SLUICE_MODEL": "/models/a",
    "SLUICE_PORT": "9100",
    "SLUICE_HOST": "0.0.0.0",
    "SLUICE_DEVICE": "cpu",
    "SLUICE_DTYPE": "float32",
    "SLUICE_MAX_NUM_SEQS": "4",
    "SLUICE_MAX_NUM_BATCHED_TOKENS": "128",
    "SLUICE_BLOCK_SIZE": "8",
    "SLUICE_NUM_KV_BLOCKS": "100",
    "SLUICE_MAX_BODY_BYTES": "2048",
    "SLUICE_GRAMMAR_TIMEOUT": "0.5",
    "SLUICE_STEP_TIME_TARGET": "0.2",
    "SLUICE_SPECULATIVE": "off",
    "SLUICE_SPEC_TOKENS": "3",
    "SLUICE_SCHEDULING": "fcfs",
}


def test_every_flag_reads_the_environment_and_flags_win() -> None:
    assert load([], EVERY_VARIABLE) == WorkerConfig(
        model="/models/a",
        port=9100,
        host="0.0.0.0",
        device="cpu",
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=128,
        scheduling="fcfs",
        step_time_target_s=0.2,
        block_size=8,
        num_kv_blocks=100,
        max_body_bytes=2048,
        grammar_timeout_s=0.5,
        speculative="off",
        spec_tokens=3,
    )
    assert load(["--kv-cache-memory", "64MiB", "--port", "1"], {}).kv_cache_memory == "64MiB"
    flagged = load(["--port", "9200", "--max-num-seqs", "8"], EVERY_VARIABLE)
    assert (flagged.port, flagged.max_num_seqs, flagged.block_size) == (9200, 8, 8)


def test_the_config_file_comes_below_the_environment_and_flags(tmp_path) -> None:
    config = tmp_path / "worker.toml"
    config.write_text(
        'port = 9300\nmax_num_seqs = 64\nkv_cache_memory = "1GiB"\nstep_time_target_s = 0\n'
    )
    from_file = load(["--config", str(config)])
    assert (from_file.port, from_file.max_num_seqs, from_file.kv_cache_memory) == (
        9300,
        64,
        "1GiB",
    )
    assert from_file.step_time_target_s == 0.0
    env = {"SLUICE_CONFIG": str(config), "SLUICE_MAX_NUM_SEQS": "16"}
    assert load([], env).max_num_seqs == 16
    assert load(["--max-num-seqs", "2"], env).max_num_seqs == 2


def test_an_unknown_key_in_the_file_is_named_with_a_suggestion(tmp_path) -> None:
    config = tmp_path / "worker.toml"
    config.write_text("port = 1\nmax_num_seq = 64\n")
    with pytest.raises(ConfigError) as e:
        load(["--config", str(config)])
    assert str(e.value) == f"{config}: unknown key 'max_num_seq' (did you mean 'max_num_seqs'?)"


def test_a_wrong_type_in_the_file_or_the_environment_is_named(tmp_path) -> None:
    config = tmp_path / "worker.toml"
    config.write_text('port = 1\nblock_size = "16"\n')
    with pytest.raises(
        ConfigError, match=r"worker.toml: 'block_size' must be an integer, not '16'"
    ):
        load(["--config", str(config)])
    with pytest.raises(ConfigError, match="SLUICE_SPEC_TOKENS: spec_tokens must be an integer"):
        load(["--port", "1"], {"SLUICE_SPEC_TOKENS": "many"})
    with pytest.raises(ConfigError, match="SLUICE_DTYPE: 'dtype' must be one of auto, "):
        load(["--port", "1"], {"SLUICE_DTYPE": "int4"})


def test_port_is_required_without_the_environment() -> None:
    with pytest.raises(ConfigError, match="--port is required"):
        load([])


def test_bad_choices_are_refused() -> None:
    with pytest.raises(SystemExit):
        load(["--port", "1", "--dtype", "int4"])


def test_the_kv_cache_is_sized_by_memory_or_by_blocks_not_both(tmp_path) -> None:
    config = tmp_path / "worker.toml"
    config.write_text('port = 1\nkv_cache_memory = "1GiB"\nnum_kv_blocks = 10\n')
    with pytest.raises(ConfigError, match="kv_cache_memory or num_kv_blocks, not both"):
        load(["--config", str(config)])
    with pytest.raises(SystemExit):
        load(["--port", "1", "--kv-cache-memory", "1GiB", "--num-kv-blocks", "10"])


def test_unusable_settings_exit_2_with_a_message_and_no_traceback(tmp_path, capsys) -> None:
    config = tmp_path / "worker.toml"
    config.write_text("port = 1\nspec_tokens = 0\n")
    assert main(["--config", str(config)]) == 2
    assert capsys.readouterr().err == ("sluice worker: spec_tokens must be at least 1, not 0\n")


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
