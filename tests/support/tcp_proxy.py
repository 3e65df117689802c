"""A TCP proxy between a test's client and a gateway that can cut a stream as a network would.

`cut_streams_after(n)` arms it: the next response that is an SSE stream (it saw
`text/event-stream` go by) has its connection cut once `n` more bytes of it have passed, wherever
they end (inside a frame, inside a UTF-8 character), so a client sees exactly what a dropped
network gives it. Only that one connection is cut; every other one, before and after, is
forwarded whole. `cut()` drops every open connection at once.
"""

from __future__ import annotations

import contextlib
import socket
import threading

SSE_MARK = b"text/event-stream"


class TcpProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.root = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._armed: int | None = None  # bytes of the next stream to let through
        self.connections = 0  # accepted so far
        self.cuts = 0  # connections cut mid-stream
        self.passed: list[bytes] = []  # what the cut stream let through, for a failure's message
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_streams_after(self, limit: int) -> None:
        """Cut the next SSE response's connection after `limit` bytes of its stream."""
        with self._lock:
            self._armed = limit

    def cut(self) -> None:
        """Drop every open connection now."""
        with self._lock:
            sockets, self._open = list(self._open), set()
        for sock in sockets:
            _drop(sock)

    def close(self) -> None:
        self._listener.close()
        self.cut()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                _drop(client)
                continue
            with self._lock:
                self.connections += 1
                self._open.update((client, server))
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _take_stream(self) -> int | None:
        with self._lock:
            limit, self._armed = self._armed, None
            return limit

    def _pump(self, source: socket.socket, sink: socket.socket, responses: bool) -> None:
        left: int | None = None  # bytes this stream may still pass before its cut
        try:
            while data := source.recv(65536):
                if responses and left is None and SSE_MARK in data:
                    left = self._take_stream()  # counted from the response's head on
                if left is not None and len(data) >= left:
                    sink.sendall(data[:left])
                    with self._lock:
                        self.cuts += 1
                        self.passed.append(data[:left])
                    break
                sink.sendall(data)
                if left is not None:
                    left -= len(data)
                    self.passed.append(data)
        except OSError:
            pass
        for sock in (source, sink):
            with self._lock:
                self._open.discard(sock)
            _drop(sock)


def _drop(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
