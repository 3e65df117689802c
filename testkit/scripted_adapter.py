"""A scripted in-process upstream for tests: replays events with delays and records aborts.

`script(request)` returns steps; a step is an event (or a batch of events) to yield, a float to
sleep for, or an exception to raise. Whether the stream was stopped early (closed by the gateway,
or by an in-band `abort()`) is recorded in `aborted`, keyed by request id. An in-band abort acts
like a worker's: at the next step (a sleep wakes early) the stream yields one `Aborted` and ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from adapters.base import ModelInfo
from adapters.events import Aborted, Event, Finish, TextDelta, Usage
from adapters.requests import ChatRequest

Step = Event | list[Event] | float | BaseException
Script = Callable[[ChatRequest], Sequence[Step]]


def text_script(pieces: Sequence[str], prompt_tokens: int = 5, delay: float = 0.0) -> Script:
    """A script that streams `pieces` one token each, then finishes with `stop` and usage."""

    def script(request: ChatRequest) -> list[Step]:
        steps: list[Step] = []
        for piece in pieces:
            if delay:
                steps.append(delay)
            steps.append(TextDelta(piece))
        steps += [Finish("stop"), Usage(prompt_tokens, len(pieces))]
        return steps

    return script


@dataclass(slots=True)
class _LiveStream:
    """One running stream's abort state: when the abort was asked, and the wake-up for sleeps."""

    wake: asyncio.Event = field(default_factory=asyncio.Event)
    abort_at: float | None = None
    sleeping: bool = False

    async def sleep(self, seconds: float) -> None:
        """Sleep, but wake as soon as an abort is asked."""
        if seconds <= 0 or self.abort_at is not None:
            await asyncio.sleep(0)
            return
        self.sleeping = True
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), seconds)
        finally:
            self.sleeping = False


class ScriptedAdapter:
    def __init__(
        self,
        model: str,
        script: Script,
        *,
        ready: bool = True,
        abortable: bool = True,
        capacity: int | None = None,
    ) -> None:
        """`capacity`: the runs it says it takes at once (the gateway's flow control queues the
        rest); None: no bound."""
        self.name = f"scripted:{model}"
        self.slots = capacity
        self.model = model
        self.script = script
        self.is_ready = ready
        self.abortable = abortable
        self.requests: list[ChatRequest] = []
        self.aborted: dict[str, bool] = {}
        self.abort_calls: list[str] = []
        self._live: dict[str, _LiveStream] = {}

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def models(self) -> list[ModelInfo]:
        return [ModelInfo(self.model, owned_by="scripted")]

    async def ready(self) -> bool:
        return self.is_ready

    def unsupported_param(self, request: ChatRequest) -> str | None:
        return None

    def capacity(self) -> int | None:
        return self.slots

    async def stream(self, request: ChatRequest, request_id: str) -> AsyncIterator[list[Event]]:
        self.requests.append(request)
        live = self._live[request_id] = _LiveStream()
        generated = 0
        try:
            for step in self.script(request):
                if live.abort_at is not None:
                    break
                if isinstance(step, BaseException):
                    raise step
                if isinstance(step, float | int):
                    await live.sleep(step)
                    continue
                batch = step if isinstance(step, list) else [step]
                generated += sum(e.tokens for e in batch if type(e) is TextDelta)
                yield batch
            # an abort asked after the last step still gets its confirmation, as promised
            self.aborted[request_id] = live.abort_at is not None
            if live.abort_at is not None:
                latency_ms = (time.monotonic() - live.abort_at) * 1000
                yield [Aborted(0, generated, 0, latency_ms)]
        except (GeneratorExit, asyncio.CancelledError):
            self.aborted[request_id] = True  # the gateway closed the stream early
            raise
        finally:
            if self._live.get(request_id) is live:
                del self._live[request_id]

    def sleeping(self, request_id: str) -> bool:
        """Whether the request's stream is in one of its script's pauses now."""
        live = self._live.get(request_id)
        return live is not None and live.sleeping

    async def abort(self, request_id: str) -> bool:
        """Stop a live stream at its next step; False when not abortable or not streaming."""
        self.abort_calls.append(request_id)
        live = self._live.get(request_id)
        if not self.abortable or live is None:
            return False
        if live.abort_at is None:
            live.abort_at = time.monotonic()
            live.wake.set()
        return True
