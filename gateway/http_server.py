"""The gateway's HTTP connections: what aiohttp's parser refuses, and clients that never finish
sending a request.

aiohttp answers a request its parser cannot read (a header past 8190 bytes, a control character
in a header value) with a plain-text 400 that quotes the offending bytes, and logs it with a
traceback; those bytes can be a credential. Here such an answer is OpenAI's error shape with a
request id, naming what was wrong without echoing any of it, and the log line names only the
error's class.

A connection counts as pending from the moment it opens, or from its next byte after an answer,
until a whole request head has arrived. A pending connection is answered 408 and closed after
`header_timeout`, and at most `max_pending` of them are kept: past that the oldest is closed.
So a client that opens connections and sends nothing, or a header a byte at a time, holds
nothing for long. The body has its own timeout, in the handler that reads it (a 408 as well).
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from typing import Any

import orjson
import structlog
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMethod, InvalidHeader, LineTooLong
from aiohttp.web_protocol import RequestHandler

log = structlog.get_logger("sluice.http")


def _parser_refusal(exc: BaseException | None) -> tuple[int, str, str]:
    """(status, code, message) for a request the parser refused; never quotes the request."""
    if isinstance(exc, LineTooLong):
        return 431, "header_too_large", "A request line or header is longer than the limit."
    if isinstance(exc, InvalidHeader):
        return 400, "invalid_header", "A request header is malformed or has an invalid value."
    if isinstance(exc, BadHttpMethod):
        return 400, "invalid_http_method", "The request method is not valid HTTP."
    return 400, "invalid_http_request", "The request line or a header is not valid HTTP/1.1."


def error_bytes(status: int, code: str, message: str, kind: str = "invalid_request_error") -> bytes:
    """A whole HTTP/1.1 error answer that closes the connection, for paths outside a handler."""
    body = orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})
    head = (
        f"HTTP/1.1 {status} {code}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"x-request-id: req_{uuid.uuid4().hex}\r\n"
        "x-should-retry: false\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


def abandon_body(request: web.BaseRequest) -> None:
    """The rest of this request's body will not be read: once it is answered, close the
    connection at once instead of reading on (aiohttp lingers up to 10 s by default)."""
    protocol = request.protocol
    if isinstance(protocol, GatewayRequestHandler):
        protocol.abandon_body()


class PendingConnections:
    """Connections that have not yet sent a whole request head, oldest first."""

    def __init__(self, header_timeout: float, max_pending: int) -> None:
        self.header_timeout = header_timeout
        self.max_pending = max_pending
        self._since: OrderedDict[GatewayRequestHandler, asyncio.TimerHandle] = OrderedDict()

    def __len__(self) -> int:
        return len(self._since)

    def add(self, conn: GatewayRequestHandler) -> None:
        if conn in self._since:
            return
        loop = asyncio.get_running_loop()
        self._since[conn] = loop.call_later(self.header_timeout, self._expire, conn)
        while len(self._since) > self.max_pending:
            oldest = next(iter(self._since))
            log.warning("pending connection dropped", reason="too_many_pending")
            self._expire(oldest)

    def discard(self, conn: GatewayRequestHandler) -> None:
        timer = self._since.pop(conn, None)
        if timer is not None:
            timer.cancel()

    def _expire(self, conn: GatewayRequestHandler) -> None:
        self.discard(conn)
        conn.refuse_slow_client()


class GatewayRequestHandler(RequestHandler):
    """aiohttp's connection protocol with the gateway's answers to what never became a request."""

    def __init__(self, manager: GatewayServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._pending = manager.pending

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._pending.add(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._pending.discard(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if data and not self._request_in_progress and not self._messages:
            self._pending.add(self)  # the first bytes of a request (a no-op while pending)
        super().data_received(data)

    def request_arrived(self) -> None:
        self._pending.discard(self)

    def abandon_body(self) -> None:
        self._lingering_time = 0.0

    def refuse_slow_client(self) -> None:
        """The request head did not arrive in time: answer 408 (if nothing was sent) and close."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not self._request_in_progress:
            transport.write(
                error_bytes(
                    408,
                    "request_timeout",
                    "The request did not arrive in time; send it whole, then wait for the answer.",
                )
            )
        self.force_close()

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # NOTE: aiohttp's message and exception text quote the request; neither is used here.
        if status == 500:
            status, code, text = 500, "internal_error", "The server had an error."
            kind = "server_error"
        else:
            status, code, text = _parser_refusal(exc)
            kind = "invalid_request_error"
        log.warning("request refused by the http parser", status=status, error=type(exc).__name__)
        body = {"error": {"message": text, "type": kind, "param": None, "code": code}}
        response = web.Response(
            status=status,
            body=orjson.dumps(body),
            content_type="application/json",
            headers={"x-request-id": "req_" + uuid.uuid4().hex, "x-should-retry": "false"},
        )
        response.force_close()
        return response


class GatewayServer(web.Server):
    """aiohttp's server, making `GatewayRequestHandler` connections."""

    def __init__(self, *args: Any, header_timeout: float, max_pending: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pending = PendingConnections(header_timeout, max_pending)
        factory = self.request_factory

        def arrived(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> Any:
            protocol.request_arrived()
            return factory(message, payload, protocol, writer, task)

        self.request_factory = arrived

    def __call__(self) -> GatewayRequestHandler:
        return GatewayRequestHandler(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """An AppRunner whose server is a `GatewayServer`.

    NOTE: this repeats what `web.AppRunner._make_server` does (start the app, freeze it, build
    the server from its handler and request factory) with the one difference of the server's
    class; aiohttp has no public switch for the connection protocol.
    """

    def __init__(
        self, app: web.Application, *, header_timeout: float, max_pending: int, **kwargs: Any
    ) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout = header_timeout
        self._max_pending = max_pending

    async def _make_server(self) -> web.Server:
        app = self._app
        app._set_loop(asyncio.get_running_loop())
        app.on_startup.freeze()
        await app.startup()
        app.freeze()
        kwargs = dict(self._kwargs)
        kwargs["debug"] = app._debug
        kwargs.update(app._handler_args or {})
        return GatewayServer(
            app._handle,
            request_factory=app._make_request,
            loop=asyncio.get_running_loop(),
            header_timeout=self._header_timeout,
            max_pending=self._max_pending,
            **kwargs,
        )
