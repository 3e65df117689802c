"""Drives the engine through a list of arrivals as a worker's clients would, synchronously.

Each request is added at the first step boundary after its arrival time; between steps, the
client side cancels a request once it has received its `cancel_after` tokens and times one out
once its deadline has passed (both through `Engine.abort`, as the worker does). Text events are
stamped when `step()` returns; finish events carry the generated-token count.

With `documents` (row (g)), a retrieval client keeps `EMBED_BACKLOG` of them queued for embedding
through the engine (Engine.add_embedding) for as long as any request decodes, one after another
from the list, round and round: `Embedded` counts the inputs and tokens it got back.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from engine_stats import Trace
from engine_workload import Arrival

EMBED_BACKLOG = 8  # inputs queued for embedding at any time while decodes run (row (g))
EMBED_TOKENS = 512  # row (g)'s inputs: retrieval chunks of up to this many tokens


def _params(max_new: int) -> Any:
    try:
        from wire.sampling_params import SamplingParams
    except ImportError:  # a --compare tree from before the module's rename
        from workers.sampling import SamplingParams
    return SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)


class Clients:
    """The requests of one run, their plans and what each client has seen."""

    def __init__(self, engine: Any, max_new: int, tag: str, grammar: Any = None) -> None:
        self.engine, self.tag, self.grammar = engine, tag, grammar
        self.params = _params(max_new)
        self.traces: dict[str, Trace] = {}
        self.plans: dict[str, Arrival] = {}
        self.finished: set[str] = set()

    def arrive(self, k: int, arrival: Arrival, at: float) -> None:
        from workers.request import EngineRequest

        request_id = f"{self.tag}-{k}"
        self.traces[request_id] = Trace(at)
        self.plans[request_id] = arrival
        constraint = () if self.grammar is None else (self.grammar,)  # older trees: no field
        self.engine.add_request(EngineRequest(request_id, arrival.prompt, self.params, *constraint))

    def leave(self, now: float) -> None:
        """Cancel the requests whose clients have read enough, time out the overdue ones."""
        for request_id, trace in self.traces.items():
            if trace.outcome != "completed" or request_id in self.finished:
                continue
            plan = self.plans[request_id]
            if plan.cancel_after is not None and trace.sent >= plan.cancel_after:
                outcome = "cancelled"
            elif plan.deadline_s is not None and now - trace.submitted >= plan.deadline_s:
                outcome = "timed_out"
            else:
                continue
            if self.engine.abort(request_id):
                trace.outcome = outcome

    def record(self, outputs: list[Any], now: float) -> None:
        for out in outputs:
            trace = self.traces[out.request_id]
            for line in out.events:
                # the engine's typed lines (or, in an older tree, their dicts)
                event = line.wire() if hasattr(line, "wire") else line
                if event["type"] == "text" and event["tokens"]:
                    trace.deliveries.append((now, event["tokens"]))
                elif event["type"] == "finish":
                    trace.tokens += event["completion_tokens"]
                    self.finished.add(out.request_id)
                elif event["type"] == "error":
                    trace.error = event["code"]
                    self.finished.add(out.request_id)


class Embedded:
    """Row (g)'s retrieval client: keeps the engine's embedding backlog full while decodes run."""

    def __init__(self, engine: Any, documents: list[list[int]], tag: str) -> None:
        self.engine, self.documents, self.tag = engine, documents, tag
        self.pending: dict[str, int] = {}  # request id -> its tokens
        self.inputs = self.tokens = self.sent = 0

    def top_up(self, decoding: bool) -> None:
        from workers.embedding import EmbeddingJob

        while decoding and len(self.pending) < EMBED_BACKLOG:
            ids = self.documents[self.sent % len(self.documents)]
            request_id = f"{self.tag}-embed-{self.sent}"
            self.engine.add_embedding(EmbeddingJob(request_id, ids))
            self.pending[request_id] = len(ids)
            self.sent += 1

    def record(self, outputs: list[Any]) -> list[Any]:
        """Take the embeddings' outputs; the rest are the chat clients'."""
        rest = []
        for out in outputs:
            if out.request_id not in self.pending:
                rest.append(out)
            elif out.finished:
                self.inputs += 1
                self.tokens += self.pending.pop(out.request_id)
        return rest


def drive(
    engine: Any,
    arrivals: list[Arrival],
    max_new: int,
    tag: str,
    grammar: Any = None,
    embedded: Embedded | None = None,
) -> list[Trace]:
    """Run `arrivals` through the engine until every request has ended; their traces."""
    clients = Clients(engine, max_new, tag, grammar)
    queue = deque(enumerate(arrivals))
    start = time.perf_counter()
    while queue or engine.has_unfinished():
        now = time.perf_counter()
        while queue and start + queue[0][1].at <= now:
            k, arrival = queue.popleft()
            clients.arrive(k, arrival, start + arrival.at)
        if not engine.has_unfinished():  # idle until the next arrival
            time.sleep(max(0.0, start + queue[0][1].at - now))
            continue
        clients.leave(now)
        if embedded is not None:
            embedded.top_up(len(clients.finished) < len(clients.traces))
        outputs = engine.step()
        if embedded is not None:
            outputs = embedded.record(outputs)
        clients.record(outputs, time.perf_counter())
    return list(clients.traces.values())
