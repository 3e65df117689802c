"""One configuration system (common/config.py): `sluice serve` reads flags over `SLUICE_*`
variables over its `--config` file over the defaults, refuses what it cannot use by name, and hands
its `[worker]` table and engine flags to the local workers on their command lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import ConfigError
from gateway.backends.from_settings import local_workers
from gateway.backends.local_worker import LocalWorker, worker_environment
from gateway.cli.main import build_parser, main
from gateway.settings import Settings, load_settings


def flags(argv: list[str]) -> dict:
    args = vars(build_parser().parse_args(["serve", *argv]))
    return {k: v for k, v in args.items() if k not in ("cmd", "func")}


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "sluice.toml"
    path.write_text(text)
    return str(path)


def test_each_layer_wins_over_the_ones_below(tmp_path):
    path = config(tmp_path, "queue_timeout = 5\n")
    assert load_settings(flags([]), {}).queue_timeout == 120.0  # the default
    assert load_settings(flags(["--config", path]), {}).queue_timeout == 5.0  # the file
    env = {"SLUICE_QUEUE_TIMEOUT": "7"}
    assert load_settings(flags(["--config", path]), env).queue_timeout == 7.0  # the variable
    both = flags(["--config", path, "--queue-timeout", "9"])
    assert load_settings(both, env).queue_timeout == 9.0  # the flag


def test_an_unknown_key_is_named_with_a_suggestion(tmp_path):
    path = config(tmp_path, 'redis_ulr = "redis://localhost"\n')
    with pytest.raises(ConfigError) as e:
        load_settings(flags(["--config", path]), {})
    assert str(e.value) == f"{path}: unknown key 'redis_ulr' (did you mean 'redis_url'?)"
    path = config(tmp_path, "nothing_like_it = 1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'nothing_like_it'$"):
        load_settings(flags(["--config", path]), {})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('port = "8000"', "'port' must be an integer, not '8000'"),
        ("queue_timeout = true", "'queue_timeout' must be a number, not True"),
        ('api_key = "k"', "'api_key' must be a list of strings, not 'k'"),
        ("host = 1", "'host' must be a string, not 1"),
        ('log_level = "loud"', "log_level must be one of debug, info, warning, error, not 'loud'"),
        ("worker = 3", "'worker' must be a table, not 3"),
        ("upstreams = 3", "'upstreams' must be a table, not 3"),
    ],
)
def test_a_wrong_type_is_named(tmp_path, text, message):
    path = config(tmp_path, text + "\n")
    with pytest.raises(ConfigError, match=message):
        load_settings(flags(["--config", path]), {})


def test_a_bad_variable_a_missing_file_and_broken_toml_are_named(tmp_path):
    with pytest.raises(ConfigError, match="SLUICE_PORT: port must be an integer, not 'http'"):
        load_settings(flags([]), {"SLUICE_PORT": "http"})
    with pytest.raises(ConfigError, match=r"nowhere\.toml: no such config file"):
        load_settings(flags(["--config", str(tmp_path / "nowhere.toml")]), {})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(flags(["--config", config(tmp_path, "port = \n")]), {})


def test_upstream_tables_still_work_and_their_typos_are_named(tmp_path):
    path = config(tmp_path, '[upstreams.big]\nurl = "http://big/v1"\ncapacity = 4\n')
    assert load_settings(flags(["--config", path]), {}).upstreams == {
        "big": {"url": "http://big/v1", "capacity": 4}
    }
    path = config(tmp_path, '[upstreams.big]\nurl = "http://big/v1"\ncapacty = 4\n')
    with pytest.raises(ConfigError, match=r"unknown key 'capacty' \(did you mean 'capacity'\?\)"):
        load_settings(flags(["--config", path]), {})


def test_the_worker_table_reaches_each_local_workers_command_line(tmp_path):
    path = config(
        tmp_path,
        "workers = 2\n[worker]\nmax_num_seqs = 8\nnum_kv_blocks = 64\nstep_time_target_s = 0\n"
        'speculative = "off"\n',
    )
    settings = load_settings(flags(["--config", path]), {})
    assert settings.worker == {
        "max_num_seqs": 8,
        "num_kv_blocks": 64,
        "step_time_target_s": 0.0,
        "speculative": "off",
    }
    workers = local_workers(settings)
    assert len(workers) == 2
    for worker in workers:
        command = worker.command()
        tail = command[command.index("--scheduling") + 2 :]
        assert tail == [
            "--max-num-seqs",
            "8",
            "--step-time-target",
            "0.0",
            "--num-kv-blocks",
            "64",
            "--speculative",
            "off",
        ]


def test_engine_flags_and_variables_win_over_the_worker_table(tmp_path):
    path = config(tmp_path, "[worker]\nmax_num_seqs = 8\nspec_tokens = 2\nblock_size = 32\n")
    env = {"SLUICE_SPEC_TOKENS": "3", "SLUICE_BLOCK_SIZE": "8"}
    argv = ["--config", path, "--max-num-seqs", "4", "--kv-cache-memory", "1GiB"]
    settings = load_settings(flags(argv), env)
    assert settings.worker == {
        "max_num_seqs": 4,
        "kv_cache_memory": "1GiB",
        "spec_tokens": 3,
        "block_size": 8,
    }
    assert load_settings(flags([]), {}).worker == {}  # the workers' own defaults
    assert LocalWorker("default", "cpu", "auto", 1024).command()[-2:] == ["--scheduling", "fair"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_num_seq = 8", r"\[worker\]: unknown key 'max_num_seq' \(did you mean 'max_num_seqs'"),
        ('kv_cache_memory = "lots"', "not a memory size: 'lots'"),
        ("spec_tokens = 0", "spec_tokens must be at least 1, not 0"),
        ('max_num_seqs = "8"', r"\[worker\]: 'max_num_seqs' must be an integer, not '8'"),
        ("port = 9000", r"\[worker\]: 'port' cannot be set here \(sluice serve chooses it\)"),
        ('model = "/m"', r"'model' cannot be set here \(set it at the top level\)"),
        ('kv_cache_memory = "1GiB"\nnum_kv_blocks = 9', "kv_cache_memory or num_kv_blocks, not"),
    ],
)
def test_what_a_worker_would_refuse_is_refused_by_serve(tmp_path, text, message):
    path = config(tmp_path, f"[worker]\n{text}\n")
    with pytest.raises(ConfigError, match=message):
        load_settings(flags(["--config", path]), {})


def test_settings_built_in_code_check_the_worker_table_too():
    with pytest.raises(ValueError, match="unknown key 'max_seqs'"):
        Settings(worker={"max_seqs": 1})
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        Settings(worker={"max_num_seqs": 0})


def test_a_local_worker_is_configured_by_its_command_line_not_inherited_variables():
    env = {
        "SLUICE_CONFIG": "/etc/sluice/gateway.toml",  # the gateway's file, not the worker's
        "SLUICE_MAX_NUM_SEQS": "2",  # read by serve, handed over as --max-num-seqs
        "SLUICE_PORT": "8000",
        "SLUICE_LOG_LEVEL": "warning",  # not a setting: the worker's log level still follows
        "SLUICE_CACHE_DIR": "/cache",
        "PATH": "/bin",
    }
    assert worker_environment(env) == {
        "SLUICE_LOG_LEVEL": "warning",
        "SLUICE_CACHE_DIR": "/cache",
        "PATH": "/bin",
    }


def test_serve_exits_2_with_the_message_and_no_traceback(tmp_path, capsys):
    path = config(tmp_path, 'redis_ulr = "redis://x"\n')
    assert main(["serve", "--config", path]) == 2
    err = capsys.readouterr().err
    assert err == f"sluice serve: {path}: unknown key 'redis_ulr' (did you mean 'redis_url'?)\n"
