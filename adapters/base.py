"""The adapter interface and the errors adapters raise.

An adapter owns one upstream (our own worker, an OpenAI-compatible server, a script) and turns its
stream into batches of internal events. A batch is whatever one network read produced, so the
gateway can frame and write it in one go.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Protocol

from adapters.events import Event
from adapters.requests import ChatRequest


@dataclass(slots=True, frozen=True)
class ModelInfo:
    id: str
    owned_by: str = "sluicegate"
    max_model_len: int | None = None
    created: int | None = None  # Unix time the backend made it available (when it says)


@dataclass(slots=True, frozen=True)
class TokenCount:
    """A prompt's tokens as a backend counted them; `source`: `worker` (our worker, with the
    model's tokenizer and chat template) or `upstream` (an upstream's own count)."""

    input_tokens: int
    source: str

    @classmethod
    def read(cls, value: object, source: str) -> TokenCount | None:
        """A backend's answer as a count; None for anything but an integer ≥ 0 (a JSON
        boolean is none)."""
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return cls(value, source)
        return None


COUNT_TIMEOUT_S = 10.0  # a count is one tokenization, maybe queued behind others: else estimate


class BackendRejected(Exception):
    """The upstream refused the request as invalid; `param` names the field when known."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str = "invalid_value",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code  # one of our own codes (an upstream's code never passes)


class BackendUnavailable(Exception):
    """No capacity or no connection: the client may retry later. `status`: the HTTP status the
    backend answered (a 429, a 503), None when it was not reached; `upstream_retry_after`: the
    seconds its own `retry-after` asked for, None when it sent none (a pool skips the member
    until then)."""

    def __init__(
        self,
        message: str,
        retry_after: float = 1.0,
        *,
        status: int | None = None,
        upstream_retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        self.status = status
        self.upstream_retry_after = upstream_retry_after


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a `retry-after` header (delay-seconds or an HTTP date); None when absent or
    unreadable. `now`: the Unix time an HTTP date is counted from (default: the clock's)."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value).timestamp()
        except (TypeError, ValueError, IndexError):
            return None
        seconds = when - (time.time() if now is None else now)
    return max(0.0, seconds) if math.isfinite(seconds) else None


class BackendFailed(Exception):
    """The upstream failed in a way the client cannot fix; the message is ours, not theirs."""


class Adapter(Protocol):
    """What the gateway needs from an upstream. Optional beside these: `stats()` (our workers'
    load, read by a pool), `capacity()`, how many runs this gateway may stream from it at
    once, None when unbounded (flow control, design §12), and `embed(inputs, dimensions,
    request_id)` → `wire.embed_body.Embeddings` where the backend serves embeddings (an adapter
    without it does not), and `count_tokens(request, request_id)` → `TokenCount | None`, the
    prompt's tokens as the backend counts them (None: it cannot say now; the gateway
    estimates; a refusal raises BackendRejected)."""

    name: str

    async def start(self) -> None:
        """Open connections; called once before serving."""

    async def close(self) -> None:
        """Release connections; called once at shutdown."""

    async def models(self) -> list[ModelInfo]:
        """The model ids this upstream serves."""

    async def ready(self) -> bool:
        """Whether the upstream can take work now."""

    def unsupported_param(self, request: ChatRequest) -> str | None:
        """The name of a requested parameter this upstream cannot honour, if any."""

    def stream(self, request: ChatRequest, request_id: str) -> AsyncIterator[list[Event]]:
        """Run the request; closing the iterator aborts it upstream."""

    async def abort(self, request_id: str) -> bool:
        """Ask the upstream to stop the request at its next step. True: the stream will confirm
        with one `Aborted` per live choice and then end. False: the upstream cannot abort
        in-band; the caller closes the stream (which aborts it there)."""
