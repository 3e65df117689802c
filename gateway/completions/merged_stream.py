"""The stream of a legacy completion with several prompts: every run's chunks, as they come,
interleaved into one SSE stream, as OpenAI streams such a call.

Each run is read from the start of its own log (as a resume from 0 would read it) and rendered
with its prompt's choice indexes (`prompt_index * n + choice`); its chunks keep its own run id
in `id`. With `include_usage`, the runs' usage chunks are held back and one chunk with their sum
ends the stream; then one `[DONE]`. The stream's `id:` lines number its own frames, not any
run's log, so it cannot be resumed as one stream: each run can (`GET /v1/completions/{id}`,
the ids being in the `x-sluice-run-ids` header).

Terminal paths: a run that fails or is cancelled ends the stream with its error frame and the
other runs are cancelled; a client that goes away (or stops reading) cancels every run at once,
with no disconnect grace (there is no one stream to come back to). A run refused before its
first event (a 400 from the worker) is answered as the call's HTTP error, as a single run's is.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
import structlog
from aiohttp import web

from adapters.chat_chunks import completion_chunks
from gateway.app_keys import METRICS, OPEN_STREAMS, RUNS, SETTINGS
from gateway.completions.merged import summed_usage
from gateway.completions.opening import PromptRun, cancel_runs
from gateway.completions.render import CompletionRenderer
from gateway.http.errors import internal_error, terminal_error
from gateway.http.sse import SSEWriter
from gateway.runs.endings import store_unavailable_error
from gateway.runs.follow import FOLLOW_BATCH, following
from gateway.runs.status import RunStatus
from gateway.state.run_store import StoreUnavailable

log = structlog.get_logger("sluice.streaming")
Item = tuple[int, list[bytes] | Exception | None]  # (run, its chunks | its failure | its end)


class MergedStream:
    """Relays the runs' chunks, in arrival order, to one writer."""

    def __init__(self, request: web.Request, runs: list[PromptRun], include_usage: bool) -> None:
        self.request = request
        self.runs = runs
        self.include_usage = include_usage
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.renderers = [CompletionRenderer(r.params, keep_usage=False) for r in runs]
        self.ended: set[int] = set()
        self.seq = 0  # the merged stream's own frame numbers

    async def respond(self, headers: dict[str, str]) -> web.StreamResponse:
        app, metrics = self.request.app, self.request.app[METRICS]
        pumps = [asyncio.ensure_future(self._pump(i)) for i in range(len(self.runs))]
        writer: SSEWriter | None = None
        try:
            first = await self._first_items()
            settings = app[SETTINGS]
            writer = await SSEWriter.open(
                self.request,
                settings.ping_interval,
                headers,
                write_timeout=settings.slow_client_timeout or None,
            )
            app[OPEN_STREAMS].add(asyncio.current_task())
            metrics.active_streams.inc()
            try:
                await self._relay(writer, first)
            finally:
                metrics.active_streams.dec()
                metrics.client_blocked.observe(writer.blocked)
        except (ConnectionError, asyncio.CancelledError) as exc:
            metrics.disconnects.inc()
            await asyncio.shield(cancel_runs(app, self.runs, "disconnect"))
            if isinstance(exc, asyncio.CancelledError) or writer is None:
                raise
        except BaseException:  # a refusal before the stream began (or a bug): none goes on
            await asyncio.shield(cancel_runs(app, self.runs, "client"))
            raise
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.wait(pumps)
            if writer is not None:
                writer.abandon()
        return writer.response

    async def _pump(self, i: int) -> None:
        """Run `i`'s rendered chunks into the queue, then its end (or its failure)."""
        run, renderer, put = self.runs[i], self.renderers[i], self.queue.put_nowait
        try:
            if run.ending is not None:  # its saved ending: the chunks rebuilt from it
                put((i, _ending_chunks(run, renderer)))
            else:
                manager = self.request.app[RUNS]
                async with (
                    following(manager, run.run_id),
                    contextlib.aclosing(manager.follow(run.run_id, 0, FOLLOW_BATCH)) as events,
                ):
                    async for batch in events:
                        chunks = [c for e in batch if (c := renderer.chunk(e[1])) is not None]
                        if chunks:
                            put((i, chunks))
            put((i, None))
        except Exception as exc:  # the relay ends the stream with it
            put((i, exc))

    async def _first_items(self) -> list[Item]:
        """What came within one heartbeat interval, once every run said something: a run that
        ended with nothing and was refused is the call's HTTP error."""
        items: list[Item] = []
        heard: set[int] = set()
        wait = self.request.app[SETTINGS].ping_interval or None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait):
                while len(heard) < len(self.runs):
                    item = await self.queue.get()
                    i, chunks = item
                    if chunks is None and i not in heard:
                        await self._raise_refusal(self.runs[i])
                    heard.add(i)
                    items.append(item)
        return items

    async def _raise_refusal(self, run: PromptRun) -> None:
        terminal = run.ending
        if terminal is None:
            terminal = (await self.request.app[RUNS].get(run.run_id)).terminal
        if terminal is not None and terminal.refused:
            raise terminal_error(terminal)

    async def _relay(self, writer: SSEWriter, first: list[Item]) -> None:
        for item in first:
            if await self._send(writer, item):
                return
        while True:
            if await self._send(writer, await self.queue.get()):
                return

    async def _send(self, writer: SSEWriter, item: Item) -> bool:
        """Write one item; True once the stream has ended."""
        i, chunks = item
        if isinstance(chunks, Exception):
            return await self._fail(writer, chunks)
        if chunks is None:
            return await self._ended(writer, i)
        for chunk in chunks:
            self.seq += 1
            await writer.send([(self.seq, chunk, None, 0)])
            if chunk.startswith(b'{"error"'):  # this run failed: the call ends with it
                await asyncio.shield(cancel_runs(self.request.app, self.runs, "client"))
                await writer.close()
                return True
        return False

    async def _ended(self, writer: SSEWriter, i: int) -> bool:
        """Run `i` has ended: the stream too when it did not complete (a run refused or
        ended with nothing in its log says so only in its record), or when it was the last."""
        run = self.runs[i]
        terminal = run.ending or (await self.request.app[RUNS].get(run.run_id)).terminal
        if terminal is not None and terminal.status is not RunStatus.COMPLETED:
            await asyncio.shield(cancel_runs(self.request.app, self.runs, "client"))
            await writer.send_error(terminal_error(terminal).body()["error"])
            await writer.close()
            return True
        self.ended.add(i)
        if len(self.ended) < len(self.runs):
            return False
        await self._finish(writer)
        return True

    async def _finish(self, writer: SSEWriter) -> None:
        if self.include_usage:
            usage = summed_usage([r.usage for r in self.renderers])
            head = self.renderers[0].head
            chunk = head | {"choices": [], "usage": usage}
            self.seq += 1
            await writer.send([(self.seq, orjson.dumps(chunk), None, 0)])
        await writer.close()

    async def _fail(self, writer: SSEWriter, exc: Exception) -> bool:
        await asyncio.shield(cancel_runs(self.request.app, self.runs, "client"))
        if isinstance(exc, StoreUnavailable):
            await writer.send_error(store_unavailable_error())
        else:
            log.error("merged stream failed", error=type(exc).__name__)
            await writer.send_error(internal_error().body()["error"])
        await writer.close()
        return True


def _ending_chunks(run: PromptRun, renderer: CompletionRenderer) -> list[bytes]:
    """A run no longer kept, from its saved ending: its chunks, or its error."""
    terminal = run.ending
    assert terminal is not None
    chunks = []
    if terminal.completion is not None:
        logged = completion_chunks(terminal.completion, run.params.include_usage)
        chunks = [c for c in map(renderer.chunk, logged) if c is not None]
    if terminal.error is not None:
        chunks.append(orjson.dumps({"error": terminal.error}))
    return chunks


async def stream_merged(
    request: web.Request, runs: list[PromptRun], include_usage: bool, headers: dict[str, Any]
) -> web.StreamResponse:
    """The runs' merged stream (see the module's docstring)."""
    return await MergedStream(request, runs, include_usage).respond(headers)
