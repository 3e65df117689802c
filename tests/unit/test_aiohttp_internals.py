"""The private names of aiohttp and redis-py that sluicegate relies on are checked at start: an
untested aiohttp or a missing name stops the gateway and the worker with the reason, before
anything is served. And the gateway's connections still go through its own protocol."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tomllib
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from common import aiohttp_internals
from common.aiohttp_internals import (
    TESTED,
    UnsupportedAiohttp,
    check,
    check_version,
    problems,
)
from gateway.http.server import GatewayRequestHandler, GatewayRunner
from gateway.state import redis_internals
from gateway.state.redis_internals import UnsupportedRedis
from tests.support.gateway import gateway_app

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_aiohttp_has_everything_used():
    assert problems(aiohttp.__version__) == []
    check()


@pytest.mark.parametrize("version", ["3.13.5", "3.15.0", "4.0.0a1", "3.9", "dev"])
def test_a_version_outside_the_tested_range_is_named(version):
    assert problems(version) == [f"aiohttp {version} is outside the tested range >=3.14,<3.15"]


@pytest.mark.parametrize("version", ["3.14.0", "3.14.5", "3.14.99.dev0"])
def test_versions_inside_the_range_pass(version):
    assert problems(version) == []


def test_a_missing_private_name_is_named_with_its_owner():
    class RequestHandler:
        _messages = ()

    required = ((RequestHandler, "_messages"), (RequestHandler, "_request_in_progress"))
    assert problems("3.14.5", required) == ["aiohttp's RequestHandler has no _request_in_progress"]


def test_a_server_without_its_connection_settings_is_named():
    class Server:
        request_handler = request_factory = handler_cancellation = None

    assert problems("3.14.5", server=Server) == ["aiohttp's Server has no _kwargs"]


def test_the_check_exits_with_every_reason(monkeypatch):
    monkeypatch.setattr(aiohttp, "__version__", "3.13.2")
    monkeypatch.setattr(aiohttp_internals, "REQUIRED", ((web.StreamResponse, "_gone"),))
    with pytest.raises(SystemExit) as info:
        check()
    assert isinstance(info.value, UnsupportedAiohttp)
    message = str(info.value)
    assert "aiohttp 3.13.2 is outside the tested range >=3.14,<3.15" in message
    assert "aiohttp's StreamResponse has no _gone" in message
    assert "common/aiohttp_internals.py" in message


def test_the_version_alone_is_checked_cheaply(monkeypatch):
    check_version()
    monkeypatch.setattr(aiohttp, "__version__", "3.13.5")
    with pytest.raises(UnsupportedAiohttp, match=r"3\.13\.5 is outside the tested range"):
        check_version()


@pytest.mark.process
def test_importing_the_gateway_on_an_untested_aiohttp_exits_with_the_reason():
    """Before any module uses what 3.14 added (`web.RequestKey`), so the message is ours."""
    code = "import aiohttp; aiohttp.__version__ = '3.13.5'; import gateway.cli.main"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1
    assert done.stderr.startswith("sluicegate cannot run on this aiohttp: aiohttp 3.13.5 is")
    assert "Traceback" not in done.stderr


def test_the_gateway_app_is_not_built_on_an_untested_aiohttp(monkeypatch):
    monkeypatch.setattr(aiohttp, "__version__", "3.15.0")
    with pytest.raises(UnsupportedAiohttp, match=r"3\.15\.0 is outside the tested range"):
        gateway_app()


def test_the_worker_app_is_not_built_on_an_untested_aiohttp(monkeypatch, tmp_path):
    from workers.config import WorkerConfig
    from workers.server import create_worker_app

    monkeypatch.setattr(aiohttp, "__version__", "3.13.0")
    with pytest.raises(UnsupportedAiohttp, match=r"3\.13\.0 is outside the tested range"):
        create_worker_app(WorkerConfig(model=str(tmp_path / "never-loaded")))


def test_pyproject_requires_the_tested_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (requirement,) = [d for d in project["dependencies"] if d.startswith("aiohttp")]
    (low, high) = (".".join(map(str, v)) for v in TESTED)
    assert requirement == f"aiohttp>={low},<{high}"


async def test_the_gateway_runner_serves_through_its_own_protocol():
    """What the internals are for: the runner's connections are `GatewayRequestHandler`s, built
    with the runner's settings, and a head that stops arriving is answered 408."""
    seen: list[object] = []

    async def hello(request: web.Request) -> web.Response:
        seen.append(request.protocol)
        return web.Response(text="hi")

    app = web.Application()
    app.router.add_get("/", hello)
    runner = GatewayRunner(app, header_timeout=0.2, max_pending=4, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        url = f"http://127.0.0.1:{port}/"
        async with aiohttp.ClientSession() as session, session.get(url) as r:
            assert (r.status, await r.text()) == (200, "hi")
        (protocol,) = seen
        assert isinstance(protocol, GatewayRequestHandler)
        assert protocol.access_logger is None  # the runner's setting reached the connection

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # and no end of the head
        answer = await asyncio.wait_for(reader.read(), timeout=5)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408 request_timeout\r\n")
        assert answer.endswith(b'"code":"request_timeout"}}')
    finally:
        await runner.cleanup()


def test_redis_py_has_the_private_writer():
    assert redis_internals.missing() == []
    redis_internals.check()


def test_a_redis_py_without_the_private_writer_exits_naming_it(monkeypatch):
    assert redis_internals.missing(object()) == ["_writer"]
    monkeypatch.setattr(redis_internals, "PRIVATE", ("_writer", "_gone"))
    with pytest.raises(UnsupportedRedis, match="Connection has no _gone"):
        redis_internals.check()
