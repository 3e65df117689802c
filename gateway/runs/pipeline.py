"""A run's pipeline, built in one place: adapter events → stages → renderer → the event log.

A stage sits between the upstream and the log and may change, hold back or drop what passes
(the safety window holds text until its checkers pass it; the tool-call stage holds a call
until it is whole and valid). Whatever a stage lets through is rendered into chunks for the log
and added to the completion object, so the log, a resume, a replay and the stored object all
hold exactly what the stages released. Adding a stage is one class with `feed` and `finish`,
and one entry in `gateway/runs/stages.py`. Stages are async: a checker may ask a remote service.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from adapters.chat_chunks import ChunkRenderer, CompletionBuilder
from adapters.events import Accepted, ErrorEvent, Event, Finish, TextDelta, ToolCallDelta, Usage
from gateway.state.run_store import Chunk, log_chunk


class Stage(Protocol):
    """One step between the adapter and the log. `stop_source` is set by a stage that ended
    every choice itself (a safety block): the driver then stops the upstream, with that as the
    cancel source, and completes the run."""

    stop_source: str | None

    async def feed(self, events: list[Event]) -> list[Event]:
        """What may pass now of these events (and of any held back before)."""

    async def finish(self) -> list[Event]:
        """The upstream is done: what is still held, to pass or drop before the ending."""


class RunPipeline:
    """Turns a run's upstream events into the chunks of its log, through its stages."""

    def __init__(
        self,
        run_id: str,
        model: str,
        created: int,
        n: int,
        stages: Sequence[Stage] = (),
        service_tier: str | None = None,
        usage_on_open: int | None = None,
    ) -> None:
        """`usage_on_open`: not None, the first role chunk carries the prompt's tokens (the
        upstream's count on accepting the run, else this estimate): a Messages run's."""
        self.run_id = run_id
        self.model = model
        self.created = created
        self.n = n
        self.stages = tuple(stages)
        self.service_tier = service_tier  # the tier serving the run, in every chunk and object
        self.renderer = ChunkRenderer(run_id, model, created, service_tier)
        self.builder = CompletionBuilder(n)
        self.opened = False  # the role chunks are in the log
        self.usage_on_open = usage_on_open

    async def feed(self, events: list[Event]) -> tuple[list[Chunk], list[Event]]:
        """The chunks for a batch of upstream events (the role chunks first, when the upstream
        accepted the run, or with its first chunk), and the events the stages let through."""
        chunks: list[Chunk] = []
        if not self.opened:
            for event in events:
                if type(event) is Accepted:
                    if event.model is not None:  # a model alias's target serves the run
                        self.serve(event.model)
                    if event.prompt_tokens is not None and self.usage_on_open is not None:
                        self.usage_on_open = event.prompt_tokens
                    chunks += self._open()
                    break
        for stage in self.stages:
            events = await stage.feed(events)
        for event in events:
            chunk = self._render(event)
            if chunk is not None:
                if not self.opened:
                    chunks += self._open()
                chunks.append(chunk)
        return chunks, events

    def plain_text(self, events: list[Event]) -> list[Chunk] | None:
        """The chunks `feed` makes of a batch of plain text deltas once the role chunks are
        out, when no stage sits in the pipeline (the batch passes whole); None for anything
        else, which goes through `feed`. The run's usual batch, in fewer steps."""
        if self.stages or not self.opened or not events:
            return None
        for event in events:
            if type(event) is not TextDelta or event.logprobs is not None or not event.text:
                return None
        add, render = self.builder.add_text, self.renderer.text
        chunks: list[Chunk] = []
        for event in events:
            add(event.text, event.index)
            chunks.append((render(event.text, event.index), event.text, event.index))
        return chunks

    async def finish(self) -> tuple[list[Chunk], list[Event]]:
        """The upstream is done: what the stages still held."""
        events: list[Event] = []
        for stage in self.stages:
            events = await stage.feed(events) + await stage.finish()
        return [c for e in events if (c := self._render(e)) is not None], events

    async def close(
        self, usage: Usage | None, include_usage: bool
    ) -> tuple[list[Chunk], ErrorEvent | None]:
        """The upstream is done: the chunks of what the stages still held, then (when the
        client asked for it) the usage chunk, with `usage` reported after an early stop where
        the stream carried none; or what the stages held and the refusal among it."""
        chunks, released = await self.finish()
        for event in released:
            if type(event) is ErrorEvent:
                return chunks, event
        if self.builder.usage is None and usage is not None:
            self.builder.add(usage)
        if include_usage and (usage_chunk := self.usage_chunk()) is not None:
            chunks.append(usage_chunk)
        return chunks, None

    @property
    def stop_source(self) -> str | None:
        """Why the upstream should stop although it has not finished (a stage ended the run)."""
        for stage in self.stages:
            if stage.stop_source is not None:
                return stage.stop_source
        return None

    def usage_chunk(self) -> Chunk | None:
        usage = self.builder.usage
        return None if usage is None else log_chunk(self.renderer.usage(usage))

    def completion(self, created: int, *, early: bool = False) -> bytes:
        return self.builder.build(
            self.run_id, self.model, created, early=early, service_tier=self.service_tier
        )

    def serve(self, model: str) -> None:
        """The model serving the run is `model`, not the one asked for (an alias's target):
        every chunk and the completion name it. Only before the first chunk."""
        self.model = model
        self.renderer = ChunkRenderer(self.run_id, model, self.created, self.service_tier)

    def _open(self) -> list[Chunk]:
        self.opened = True
        prompt = self.usage_on_open
        usage = None if prompt is None else Usage(prompt, 0)
        return [log_chunk(self.renderer.role(i, usage if i == 0 else None)) for i in range(self.n)]

    def _render(self, event: Event) -> Chunk | None:
        kind = type(event)
        if kind is TextDelta:
            self.builder.add(event)
            if not event.text and not event.logprobs:  # tokens without text (an EOS): counted
                return None
            if event.logprobs is None:  # plain text: mergeable for a client that fell behind
                return (self.renderer.render(event), event.text, event.index)
            return (self.renderer.render(event), None, 0)
        if kind is ToolCallDelta or kind is Finish:
            self.builder.add(event)
            return (self.renderer.render(event), None, 0)
        if kind is Usage:
            self.builder.add(event)
        return None
