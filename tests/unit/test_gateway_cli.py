"""Gateway settings and command line: precedence, parsing, and a light gateway process."""

from __future__ import annotations

import asyncio
import sys

import pytest
import uvloop

from common.config import ConfigError
from gateway.cli.main import build_parser
from gateway.event_loop import loop_factory
from gateway.settings import Settings, UpstreamSpec, load_settings


def flags(argv: list[str]) -> dict:
    args = vars(build_parser().parse_args(["serve", *argv]))
    return {k: v for k, v in args.items() if k not in ("cmd", "func")}


def test_flags_win_over_environment_which_wins_over_the_config_file(tmp_path):
    config = tmp_path / "sluice.toml"
    config.write_text(
        'port = 7000\nhost = "0.0.0.0"\ndisconnect_grace = 3.5\napi_key = ["from-file"]\n'
    )
    env = {"SLUICE_PORT": "7100", "SLUICE_API_KEY": "k1,k2"}
    settings = load_settings(flags(["--config", str(config)]), env)
    assert (settings.port, settings.host, settings.disconnect_grace) == (7100, "0.0.0.0", 3.5)
    assert settings.api_key == ["k1", "k2"]
    settings = load_settings(
        flags(["--config", str(config), "--port", "7200", "--api-key", "a"]), env
    )
    assert (settings.port, settings.api_key) == (7200, ["a"])


def test_defaults_start_a_local_worker_unless_only_remote_backends_are_named():
    assert load_settings(flags([]), {}).starts_local_workers
    remote = load_settings(flags(["--upstream", "m=http://h:1/v1"]), {})
    assert not remote.starts_local_workers
    assert remote.upstream_specs() == [UpstreamSpec("m", "http://h:1/v1")]
    both = load_settings(flags(["--upstream", "m=http://h:1/v1", "--model", "/p"]), {})
    assert both.starts_local_workers


def test_the_shutdown_timeout_reads_its_flag_and_the_environment():
    env = {"SLUICE_SHUTDOWN_TIMEOUT": "3"}
    assert load_settings(flags([]), {}).shutdown_timeout == 30.0
    assert load_settings(flags([]), env).shutdown_timeout == 3.0
    assert load_settings(flags(["--shutdown-timeout", "1.5"]), env).shutdown_timeout == 1.5


@pytest.mark.parametrize(
    "spec", ["nourl", "=http://x", "m=ftp://x", "m=", "m=http://x#cap=2", "m=http://x#capacity=0"]
)
def test_bad_upstream_specs_are_refused(spec):
    with pytest.raises(ValueError, match=r"NAME=BASE_URL|capacity"):
        Settings(upstream=[spec]).upstream_specs()


def test_an_upstreams_capacity_comes_from_its_flag_or_its_config_table(tmp_path):
    config = tmp_path / "sluice.toml"
    config.write_text('[upstreams.big]\nurl = "http://big:8000/v1"\ncapacity = 64\n')
    settings = load_settings(
        flags(["--upstream", "qwen=http://vllm:8000/v1#capacity=8", "--config", str(config)]), {}
    )
    assert settings.upstream_specs() == [
        UpstreamSpec("qwen", "http://vllm:8000/v1", 8),
        UpstreamSpec("big", "http://big:8000/v1", 64),
    ]
    assert not settings.starts_local_workers
    with pytest.raises(ValueError, match="capacity"):
        Settings(upstreams={"x": {"url": "http://x/v1", "capacity": -1}}).upstream_specs()
    with pytest.raises(ValueError, match="url and capacity only"):
        Settings(upstreams={"x": {"url": "http://x/v1", "weight": 2}}).upstream_specs()


def test_the_event_loop_is_uvloop_unless_set_and_refuses_a_loop_it_does_not_know():
    assert load_settings(flags([]), {}).event_loop == "uvloop"
    assert load_settings(flags([]), {"SLUICE_EVENT_LOOP": "asyncio"}).event_loop == "asyncio"
    with pytest.raises(ValueError, match="event_loop must be one of uvloop, asyncio"):
        load_settings(flags([]), {"SLUICE_EVENT_LOOP": "trio"})
    for name, kind in (("uvloop", uvloop.Loop), ("asyncio", asyncio.AbstractEventLoop)):
        loop = loop_factory(name)()
        try:
            assert isinstance(loop, kind)
        finally:
            loop.close()


def test_uvloop_asked_for_but_not_installed_is_a_config_error_naming_the_way_out(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # its import now fails
    with pytest.raises(ConfigError, match=r'uvloop is not installed.*event_loop = "asyncio"'):
        loop_factory("uvloop")
