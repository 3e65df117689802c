"""Asking a running process how it is, for the tests and the soak alike: one metric sample from
its `/metrics`, and whether a redis-server answers PING."""

from __future__ import annotations

import socket

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scraped(root: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples at `root`/metrics whose labels include `labels`."""
    text = httpx.get(f"{root}/metrics", timeout=5).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def redis_answers(port: int) -> bool:
    """Whether a redis-server on 127.0.0.1:`port` answers PING now."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False
