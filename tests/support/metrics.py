"""Reading a running process's `/metrics` in tests (testkit/probes.py, shared with the soak)."""

from __future__ import annotations

from testkit.probes import scraped

__all__ = ["scraped"]
