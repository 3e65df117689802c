"""The gateway's HTTP connections: what aiohttp's parser refuses, and clients that never finish
sending a request.

aiohttp answers a request its parser cannot read (a header past 8190 bytes, a control character
in a header value) with a plain-text 400 that quotes the offending bytes, and logs it with a
traceback; those bytes can be a credential. Here such an answer is OpenAI's error shape with a
request id, naming what was wrong without echoing any of it, and the log line names only the
error's class.

A connection counts as pending from the moment it opens, or from its next byte after an answer,
until a whole request, head and body, has arrived. A connection still sending its head is
answered 408 and closed after `header_timeout`; the body has its own timeout, in the handler that
reads it (a 408 as well). At most `max_pending` connections are pending, whichever part they are
sending: past that the oldest is refused, with the same 408. So a client that opens connections
and sends nothing, or a header or a body a byte at a time, holds nothing for long.

aiohttp has no public switch for any of this; the private names it takes are used through
common/aiohttp_internals.py, which lists them and checks them at start.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from typing import Any

import orjson
import structlog
from aiohttp import StreamReader, web

from common.aiohttp_internals import (
    BadHttpMethod,
    InvalidHeader,
    LineTooLong,
    ProtocolRunner,
    between_requests,
    handling_request,
    stop_lingering,
)

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


class BodyOverdue(TimeoutError):
    """A request body still arriving when its connection was refused as the oldest of too many
    pending. A TimeoutError, so the handler reading the body answers it as the body's own
    timeout (408, `read_json`), and aiohttp's lingering read after an answer stops quietly."""


class PendingConnections:
    """Connections that have not yet sent a whole request, oldest first."""

    def __init__(self, header_timeout: float, max_pending: int) -> None:
        self.header_timeout = header_timeout
        self.max_pending = max_pending
        # a connection still sending its head has its timer; one sending its body has None
        self._since: OrderedDict[GatewayRequestHandler, asyncio.TimerHandle | None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._since)

    def add(self, conn: GatewayRequestHandler) -> None:
        """`conn` starts a request: it has `header_timeout` to send the head."""
        if conn in self._since:
            return
        loop = asyncio.get_running_loop()
        self._keep(conn, loop.call_later(self.header_timeout, self._expire, conn))

    def head_arrived(self, conn: GatewayRequestHandler) -> None:
        """`conn` sent its head but not yet its body: it keeps its place in line, without a
        timer (the handler reading the body times it)."""
        timer = self._since.get(conn)
        if timer is not None:
            timer.cancel()
        if conn in self._since:
            self._since[conn] = None  # NOTE: assigning to a key keeps its place in the order
        else:  # a pipelined request, whose first bytes came while another was being handled
            self._keep(conn, None)

    def discard(self, conn: GatewayRequestHandler) -> None:
        timer = self._since.pop(conn, None)
        if timer is not None:
            timer.cancel()

    def _keep(self, conn: GatewayRequestHandler, timer: asyncio.TimerHandle | None) -> None:
        self._since[conn] = timer
        while len(self._since) > self.max_pending:
            oldest = next(iter(self._since))
            log.warning("pending connection dropped", reason="too_many_pending")
            self._expire(oldest)

    def _expire(self, conn: GatewayRequestHandler) -> None:
        self.discard(conn)
        conn.refuse_slow_client()


class GatewayRequestHandler(web.RequestHandler):
    """aiohttp's connection protocol with the gateway's answers to what never became a request."""

    def __init__(self, manager: GatewayServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._pending = manager.pending
        self._body: StreamReader | None = None  # the request body still arriving, if any

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._pending.add(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._body = None
        self._pending.discard(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if data and between_requests(self):
            self._pending.add(self)  # the first bytes of a request (a no-op while pending)
        super().data_received(data)

    def request_arrived(self, body: StreamReader) -> None:
        """A request's head is whole; the connection stays pending until its body is too."""
        if body.is_eof():  # no body, or all of it came with the head
            self._pending.discard(self)
            return
        self._body = body
        self._pending.head_arrived(self)
        body.on_eof(self._body_arrived)  # NOTE: not called if the body fails (then it closes)

    def _body_arrived(self) -> None:
        self._body = None
        self._pending.discard(self)

    def abandon_body(self) -> None:
        stop_lingering(self)

    def refuse_slow_client(self) -> None:
        """The request did not arrive in time, or is the oldest of too many pending. Its body
        (when the head is whole) fails, and the handler reading it answers 408 and closes;
        otherwise the 408 is written here (if nothing was sent) and the connection closed.

        NOTE: a handler that never reads the body keeps the connection until it answers; it
        no longer counts as pending meanwhile."""
        body, self._body = self._body, None
        if body is not None:
            self.abandon_body()
            body.set_exception(BodyOverdue())
            return
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not handling_request(self):
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

    def __init__(
        self,
        handler: Any,
        *,
        header_timeout: float,
        max_pending: int,
        request_factory: Any = None,
        handler_cancellation: bool = False,
        loop: asyncio.AbstractEventLoop | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            handler,
            request_factory=request_factory,
            handler_cancellation=handler_cancellation,
            loop=loop,
            **kwargs,
        )
        # what each connection is built with: aiohttp's server keeps the same, privately
        self._connection_loop = loop or asyncio.get_running_loop()
        self._connection_kwargs = kwargs
        self.pending = PendingConnections(header_timeout, max_pending)
        factory = self.request_factory

        def arrived(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> Any:
            protocol.request_arrived(payload)
            return factory(message, payload, protocol, writer, task)

        self.request_factory = arrived

    def __call__(self) -> GatewayRequestHandler:
        return GatewayRequestHandler(self, loop=self._connection_loop, **self._connection_kwargs)


class GatewayRunner(ProtocolRunner):
    """An AppRunner whose server is a `GatewayServer`."""

    def __init__(
        self, app: web.Application, *, header_timeout: float, max_pending: int, **kwargs: Any
    ) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout = header_timeout
        self._max_pending = max_pending

    def build_server(self, handler: Any, **kwargs: Any) -> web.Server:
        return GatewayServer(
            handler, header_timeout=self._header_timeout, max_pending=self._max_pending, **kwargs
        )
