"""Every use of aiohttp's private names, in one place, and the check at start that they exist.

aiohttp has no public switch for three things the gateway's HTTP edge (gateway/http/) needs: a
connection protocol of its own (to answer what never became a request), the state of a
connection between requests, and a stream whose headers leave with its first events; nor for
its client's request body to leave at once on Python 3.11. That takes these names, each checked
by `check()` when the gateway app or a worker app is built:

- `web.AppRunner._make_server()`: overridden by `ProtocolRunner`, which lets aiohttp build its
  server as usual (the app started and frozen) and then builds one of its own class from it.
- `web.Server._kwargs`: the connection settings (the runner's, and the app's handler args) that
  aiohttp's server passes to each connection; `ProtocolRunner` hands them to its own server,
  with the server's undocumented `request_handler`, `request_factory`, `handler_cancellation`.
- `web.RequestHandler._request_in_progress` and `._messages`: whether a connection is between
  requests, so the first byte of the next one starts its header timer.
- `web.RequestHandler._lingering_time`: zero closes a connection once it is answered, instead of
  reading on for a body nobody will read.
- `web.RequestHandler.handle_error(request, status, exc, message)`: a public name, but not
  documented; overridden to answer what the parser refused in OpenAI's error shape.
- `web.StreamResponse._send_headers_immediately`: False holds a stream's headers until its first
  write (aiohttp's own switch for `web.Response`), so headers and the first events leave in one.
- `ClientRequest.write_bytes`: the coroutine aiohttp's client writes a request's body in, as
  a task of its own; picked out by the loop's task factory (gateway/eager_tasks.py) to start
  eagerly on Python 3.11, as aiohttp itself starts it on 3.12.
- `aiohttp.http_exceptions` (`BadHttpMethod`, `InvalidHeader`, `LineTooLong`,
  `ContentEncodingError`): the parser's errors, which aiohttp does not export; told apart to
  say what was wrong with a request.

`TESTED` is the range the test suite runs against, and pyproject's requirement says the same (a
unit test keeps the two equal). The floor is 3.14, the release that added `web.RequestKey`;
`check_version()` runs when the gateway package is imported, before anything uses it. Torch-free:
the worker imports it too, to check the range at its start.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
from aiohttp import ClientRequest, web
from aiohttp.http_exceptions import (
    BadHttpMethod,
    ContentEncodingError,
    InvalidHeader,
    LineTooLong,
)

__all__ = [
    "TESTED",
    "BadHttpMethod",
    "ContentEncodingError",
    "HeadersWithFirstWrite",
    "InvalidHeader",
    "LineTooLong",
    "ProtocolRunner",
    "UnsupportedAiohttp",
    "between_requests",
    "check",
    "check_version",
    "handling_request",
    "problems",
    "stop_lingering",
    "version_problem",
    "writes_request_body",
]

# aiohttp major.minor: from the first (included) to the second (excluded)
TESTED = ((3, 14), (3, 15))

# (owner, name) for each private name used below; `Server._kwargs` is an instance attribute
# and is looked for on a server built for the check.
REQUIRED: tuple[tuple[type, str], ...] = (
    (web.AppRunner, "_make_server"),
    (web.RequestHandler, "_request_in_progress"),
    (web.RequestHandler, "_messages"),
    (web.RequestHandler, "_lingering_time"),
    (web.RequestHandler, "handle_error"),
    (web.StreamResponse, "_send_headers_immediately"),
    (ClientRequest, "write_bytes"),
)
SERVER_REQUIRED = ("_kwargs", "request_handler", "request_factory", "handler_cancellation")


class UnsupportedAiohttp(SystemExit):
    """The installed aiohttp is outside the tested range or lacks a name used here. A
    SystemExit: uncaught, the process prints the message and exits 1 before serving."""


def between_requests(protocol: web.RequestHandler) -> bool:
    """No request is being handled on this connection, and none is queued behind it."""
    return not protocol._request_in_progress and not protocol._messages


def handling_request(protocol: web.RequestHandler) -> bool:
    """A request on this connection reached its handler (an answer may be on its way)."""
    return protocol._request_in_progress


def writes_request_body(coro: Coroutine[Any, Any, Any]) -> bool:
    """Whether `coro` is aiohttp's client writing a request's body (`ClientRequest.write_bytes`)."""
    return getattr(coro, "cr_code", None) is ClientRequest.write_bytes.__code__


def stop_lingering(protocol: web.RequestHandler) -> None:
    """Close the connection once the current request is answered, without reading the rest of
    its body (aiohttp lingers up to 10 s by default)."""
    protocol._lingering_time = 0.0


class HeadersWithFirstWrite(web.StreamResponse):
    """A stream response whose headers wait for its first write (aiohttp's switch for responses
    with a body ready), so headers and the first frames leave in one write."""

    _send_headers_immediately = False


class ProtocolRunner(web.AppRunner):
    """An AppRunner whose server is built by `build_server`: aiohttp has no public switch for the
    class of a server's connections, so a subclass of `web.Server` is the way to choose it."""

    def build_server(self, handler: Any, **kwargs: Any) -> web.Server:
        """The server, from the arguments aiohttp built its own `web.Server` with."""
        raise NotImplementedError

    async def _make_server(self) -> web.Server:
        built = await super()._make_server()  # starts and freezes the app
        return self.build_server(
            built.request_handler,
            request_factory=built.request_factory,
            handler_cancellation=built.handler_cancellation,
            loop=asyncio.get_running_loop(),
            **built._kwargs,
        )


def _version(text: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", text)
    return (int(match[1]), int(match[2])) if match else None


def _shown(version: tuple[int, int]) -> str:
    return ".".join(map(str, version))


def version_problem(version: str) -> str | None:
    """Why `version` is not one the suite ran against, if it is not."""
    low, high = TESTED
    parsed = _version(version)
    if parsed is not None and low <= parsed < high:
        return None
    return f"aiohttp {version} is outside the tested range >={_shown(low)},<{_shown(high)}"


def problems(
    version: str,
    required: tuple[tuple[type, str], ...] | None = None,
    server: Callable[[], object] | None = None,
) -> list[str]:
    """What is wrong with this aiohttp for the code here: an untested version, a missing name.
    `required` and `server` stand in for `REQUIRED` and a real server (tests)."""
    found = [untested] if (untested := version_problem(version)) else []
    for owner, name in REQUIRED if required is None else required:
        if not hasattr(owner, name):
            found.append(f"aiohttp's {owner.__name__} has no {name}")
    probe = (server or _probe_server)()
    for name in SERVER_REQUIRED:
        if not hasattr(probe, name):
            found.append(f"aiohttp's Server has no {name}")
    return found


def _probe_server() -> web.Server:
    """A server built only to look at its attributes; it never gets a connection."""

    async def nothing(request: web.BaseRequest) -> web.StreamResponse:
        raise NotImplementedError

    loop = asyncio.new_event_loop()
    try:
        return web.Server(nothing, loop=loop)
    finally:
        loop.close()


def _refuse(found: list[str]) -> UnsupportedAiohttp:
    return UnsupportedAiohttp(
        "sluicegate cannot run on this aiohttp: "
        + "; ".join(found)
        + ". Install the tested range (pip install -e .); common/aiohttp_internals.py lists"
        " the private names it relies on."
    )


def check_version() -> None:
    """Fail on an untested aiohttp; cheap enough for a package's import (gateway/__init__.py),
    which comes before any module uses what the range promises (`web.RequestKey`)."""
    if untested := version_problem(aiohttp.__version__):
        raise _refuse([untested])


def check() -> None:
    """Fail at start, with the reason, where the installed aiohttp would break at run time."""
    if found := problems(aiohttp.__version__):
        raise _refuse(found)
