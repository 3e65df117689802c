"""A scripted in-process upstream for tests: replays events with delays and records aborts.

`script(request)` returns steps; a step is an event (or a batch of events) to yield, a float to
sleep for, or an exception to raise. Whether the gateway closed the stream early is recorded in
`aborted`, keyed by request id.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

from adapters.base import ModelInfo
from adapters.events import Event, Finish, TextDelta, Usage
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


class ScriptedAdapter:
    def __init__(self, model: str, script: Script, *, ready: bool = True) -> None:
        self.name = f"scripted:{model}"
        self.model = model
        self.script = script
        self.is_ready = ready
        self.requests: list[ChatRequest] = []
        self.aborted: dict[str, bool] = {}

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

    async def stream(self, request: ChatRequest, request_id: str) -> AsyncIterator[list[Event]]:
        self.requests.append(request)
        try:
            for step in self.script(request):
                if isinstance(step, BaseException):
                    raise step
                if isinstance(step, float | int):
                    await asyncio.sleep(step)
                    continue
                yield step if isinstance(step, list) else [step]
        except (GeneratorExit, asyncio.CancelledError):
            self.aborted[request_id] = True  # the gateway closed the stream early
            raise
        else:
            self.aborted[request_id] = False
