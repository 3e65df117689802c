"""The engine loop on its own thread, streamed to asyncio tasks.

Model work never runs on the event loop. The loop side hands requests and aborts to the thread
through a condition variable (the thread sleeps on it when idle, no busy spin); the thread hands
each step's outputs back in one `call_soon_threadsafe`, batched per step, never per token. Each
`generate()` stream is a queue that the loop side fills; a stream that is cancelled or closed
early aborts its request (the engine drops it at its next step boundary).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import structlog

from wire import api
from workers.embedding import EmbeddingJob, PooledLine
from workers.engine import ENGINE_ERROR, Engine
from workers.engine_outputs import ContextTooLong, EngineStats, InvalidContinuation, RequestOutput
from workers.request import EngineRequest

log = structlog.get_logger("sluice.worker.loop")

SHUTTING_DOWN = "shutting_down"
INVALID_CONTINUATION = "invalid_continuation"


class DuplicateRequest(ValueError):
    """A request with this id is already streaming."""


class EmbeddingFailed(RuntimeError):
    """The engine ended an input to embed with an error line (its code and message)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class EngineNotRunning(RuntimeError):
    """generate() was called before start() or after stop()."""


StepHook = Callable[[float, EngineStats], None]


class AsyncEngine:
    """Owns the engine thread; every engine call happens on that thread."""

    def __init__(self, engine: Engine, *, on_step: StepHook | None = None) -> None:
        self._engine = engine
        self._on_step = on_step
        self._cond = threading.Condition()
        self._inbox: list[EngineRequest | EmbeddingJob] = []
        self._aborts: list[tuple[str, float]] = []  # request id, when the abort arrived
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._orphans: set[str] = set()  # streams closed early whose requests the engine holds
        self._stats = engine.stats()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def start(self) -> None:
        """Start the engine thread; call from the event loop the streams will live on."""
        if self._thread is not None:
            raise RuntimeError("the engine loop was already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="sluice-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the thread; live streams end with an `error` event (`shutting_down`)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        await asyncio.sleep(0)  # let the final deliveries run

    def stats(self) -> EngineStats:
        """The snapshot after the last step; requests not yet handed over count as waiting."""
        with self._cond:
            return replace(self._stats, waiting=self._stats.waiting + len(self._inbox))

    def holds(self, request_id: str) -> bool:
        """Whether the id is taken: its stream is live, or its request still in the engine."""
        return request_id in self._streams

    def abort(self, request_id: str) -> bool:
        """Abort a live stream's request; False for an unknown or finished id. Idempotent."""
        if request_id not in self._streams:
            return False
        self._send_abort(request_id)
        return True

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    def check_fits(self, prompt_len: int, max_tokens: int | None, continuation: int = 0) -> None:
        """Raises ContextTooLong for a request that can never run here (Engine.check_fits)."""
        self._engine.check_fits(prompt_len, max_tokens, continuation)

    async def embed(self, jobs: list[EmbeddingJob]) -> list[list[float]]:
        """The jobs' vectors, in order, computed through the engine's steps (embedding.py).
        Raises EmbeddingFailed for a job the engine failed; the others are aborted then, as
        they are when the caller is cancelled."""
        tasks = [asyncio.ensure_future(self._embed_one(job)) for job in jobs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # one failed, or the caller went: the others stop at the next step boundary
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _embed_one(self, job: EmbeddingJob) -> list[float]:
        vector = None
        async for line in self.generate(job):
            if isinstance(line, PooledLine):
                vector = line.vector
            elif isinstance(line, api.ErrorLine):
                raise EmbeddingFailed(line.code, line.message)
        if vector is None:  # NOTE: ended without its vector: aborted, or the engine stopped
            raise EmbeddingFailed(SHUTTING_DOWN, "the input was not embedded")
        return vector

    async def generate(self, request: EngineRequest | EmbeddingJob) -> AsyncIterator[api.Line]:
        """Yield the worker-api lines of one request: `start`, then what the engine produces.

        NOTE: this is the one place a live request id is refused again (DuplicateRequest): an id
        stays taken until the engine has let go of its request, also when its stream was closed
        early (the abort takes effect at the next step boundary; the id is free after that)."""
        if not self.is_running:
            raise EngineNotRunning("the engine loop is not running")
        if request.request_id in self._streams:
            raise DuplicateRequest(f"request {request.request_id!r} is already running")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request.request_id] = queue
        with self._cond:
            self._inbox.append(request)
            self._cond.notify()
        finished = False
        try:
            yield api.AcceptedLine(len(request.prompt_ids))
            while True:
                output = await queue.get()
                for event in output.events:
                    yield event
                if output.finished:
                    finished = True
                    return
        except (asyncio.CancelledError, GeneratorExit):
            self._send_abort(request.request_id)
            raise
        finally:
            if finished or not self.is_running:
                self._streams.pop(request.request_id, None)
            else:
                self._orphans.add(request.request_id)  # released when the engine lets go

    # -- the loop side ---------------------------------------------------------------------------

    def _send_abort(self, request_id: str) -> None:
        arrived_at = time.monotonic()
        with self._cond:
            self._aborts.append((request_id, arrived_at))
            self._cond.notify()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.request_id in self._orphans:  # nobody reads it any more
                if output.finished:
                    self._orphans.discard(output.request_id)
                    self._streams.pop(output.request_id, None)
                continue
            queue = self._streams.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)

    def _hand_over(self, outputs: list[RequestOutput]) -> None:
        if not outputs or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    # -- the engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        engine = self._engine
        while True:
            with self._cond:
                while not (
                    self._inbox or self._aborts or self._stopping or engine.has_unfinished()
                ):
                    self._cond.wait()
                if self._stopping:
                    break
                # NOTE: hand-over and snapshot under one lock, so stats() never misses a
                # request that has left the inbox but is not yet in the snapshot.
                outputs = self._admit(self._inbox)
                self._inbox = []
                for request_id, arrived_at in self._aborts:
                    engine.abort(request_id, arrived_at)
                if self._aborts:
                    outputs += engine.apply_aborts()
                self._aborts = []
                self._stats = engine.stats()
            if outputs:  # aborts confirmed before the next forward, not after it
                self._hand_over(outputs)
                outputs = []
            if engine.has_unfinished():
                outputs += self._step()
            with self._cond:
                self._stats = engine.stats()
            self._hand_over(outputs)
        message = "the worker is shutting down"
        with self._cond:
            never_started, self._inbox = self._inbox, []
        event = api.ErrorLine(SHUTTING_DOWN, message)
        outputs = [RequestOutput(r.request_id, [event], finished=True) for r in never_started]
        self._hand_over(outputs + engine.fail_all(SHUTTING_DOWN, message))

    def _admit(self, new: list[EngineRequest | EmbeddingJob]) -> list[RequestOutput]:
        outputs = []
        for request in new:
            try:
                if isinstance(request, EmbeddingJob):
                    self._engine.add_embedding(request)
                else:
                    self._engine.add_request(request)
            except ContextTooLong as e:  # a caller that did not check first (the service does)
                event = api.ErrorLine("context_length_exceeded", str(e))
                outputs.append(RequestOutput(request.request_id, [event], finished=True))
            except InvalidContinuation as e:  # the service checks the grammar, not the stops
                event = api.ErrorLine(INVALID_CONTINUATION, str(e))
                outputs.append(RequestOutput(request.request_id, [event], finished=True))
        return outputs

    def _step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        try:
            outputs = self._engine.step()
        except Exception as e:  # NOTE: a bug in the engine itself: fail what is live, keep going
            log.error("engine step failed", error=type(e).__name__)
            outputs = self._engine.fail_all(ENGINE_ERROR, "the engine failed")
        if self._on_step is not None:
            self._on_step(time.perf_counter() - started, self._engine.stats())
        return outputs
