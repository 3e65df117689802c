"""The synchronous engine: `step()` = apply aborts → schedule → run → sample → postprocess.

Single-threaded by design: only the engine loop's thread calls it (see async_engine.py), so
aborts recorded between steps take effect at the next step boundary. The core is the simple one
(FIFO admission up to `max_num_seqs` sequences, one DynamicCache per sequence, see
model_runner.py); the paged-KV scheduler of the next milestone replaces it behind this interface.
One request's failure never stops the loop: that request gets an `error` event, the rest go on.
"""

from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from workers import protocol
from workers.detokenizer import IncrementalDetokenizer, TokenTable
from workers.model_loader import context_length
from workers.model_runner import ModelRunner
from workers.request import FINISH_REASON, EngineRequest, Request, RequestStatus, Sequence
from workers.sampler import Sampler
from workers.stop import StopContext, StopStringHoldback, check_stop

log = structlog.get_logger("sluice.worker.engine")

ENGINE_ERROR = "engine_error"


@dataclass(slots=True)
class RequestOutput:
    """Events produced for one request in one step; `finished` when it sent its last event."""

    request_id: str
    events: list[dict[str, Any]] = field(default_factory=list)
    finished: bool = False


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for /v1/stats and /metrics. KV and prefix-cache fields stay 0 until paged KV."""

    waiting: int
    running: int
    generated_tokens_total: int
    last_step_tokens: int = 0
    preemptions_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_queries: int = 0


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else eos or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _log_failure(stage: str, request_id: str, error: Exception) -> None:
    """Context for the operator, never a stack trace (DESIGN §4)."""
    log.error(
        "request failed",
        stage=stage,
        request_id=request_id,
        error=type(error).__name__,
        detail=str(error)[:200],
    )


def _seed_for(seed: int | None, index: int) -> int:
    """Choice 0 uses the seed as given; other choices derive their own, deterministically."""
    if seed is None:
        return secrets.randbits(63)
    return seed if index == 0 else hash((seed, index)) & 0x7FFF_FFFF_FFFF_FFFF


class Engine:
    """Runs requests to completion, one token per live sequence per step."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_num_seqs: int = 32,
        max_model_len: int | None = None,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        self.runner = ModelRunner(model)
        self.vocab_size: int = model.config.vocab_size
        self.max_model_len: int = max_model_len or context_length(model.config)
        self.max_num_seqs = max_num_seqs
        self.table = TokenTable.from_tokenizer(tokenizer, self.vocab_size)
        self.sampler = Sampler(self.table)
        self.stop_ctx = StopContext(_eos_ids(model, tokenizer), self.max_model_len)
        self._requests: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._abort_pending: set[str] = set()
        self._generated_total = 0
        self._last_step_tokens = 0

    # -- the interface --------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request (FIFO). Raises ValueError if its id is already live."""
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already running")
        params = request.params
        budget = self.max_model_len - len(request.prompt_ids)
        max_tokens = min(params.max_tokens or budget, budget)
        sequences = [
            Sequence(
                request_id=request.request_id,
                index=i,
                params=params,
                prompt_ids=request.prompt_ids,
                max_tokens=max_tokens,
                detokenizer=IncrementalDetokenizer(self.table.text_bytes),
                holdback=StopStringHoldback(params.stop),
                generator=self._generator(params.seed, i) if not params.greedy else None,
            )
            for i in range(params.n)
        ]
        req = Request(request.request_id, request.prompt_ids, params, sequences)
        self._requests[req.request_id] = req
        self._waiting.append(req)

    def abort(self, request_id: str) -> bool:
        """Mark a live request for abort at the next step; unknown or finished ids are a no-op."""
        if request_id not in self._requests:
            return False
        self._abort_pending.add(request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def stats(self) -> EngineStats:
        return EngineStats(
            waiting=len(self._waiting),
            running=len(self._running),
            generated_tokens_total=self._generated_total,
            last_step_tokens=self._last_step_tokens,
        )

    def step(self) -> list[RequestOutput]:
        """Advance every running sequence by one token; return the events this produced."""
        outputs: dict[str, RequestOutput] = {}
        self._apply_aborts(outputs)
        self._schedule()
        rows, logits = self._run(outputs)
        if rows:
            self._sample_and_postprocess(rows, logits, outputs)
        self._retire(outputs)
        return list(outputs.values())

    def fail_all(self, code: str, message: str) -> list[RequestOutput]:
        """Fail every live request (engine-wide fault or shutdown)."""
        outputs: dict[str, RequestOutput] = {}
        for req in list(self._requests.values()):
            self._fail(req, code, message, outputs)
        self._retire(outputs)
        return list(outputs.values())

    # -- one step -------------------------------------------------------------------------------

    def _generator(self, seed: int | None, index: int) -> torch.Generator:
        generator = torch.Generator(device=self.runner.device)
        generator.manual_seed(_seed_for(seed, index))
        return generator

    def _out(self, outputs: dict[str, RequestOutput], request_id: str) -> RequestOutput:
        if request_id not in outputs:
            outputs[request_id] = RequestOutput(request_id)
        return outputs[request_id]

    def _apply_aborts(self, outputs: dict[str, RequestOutput]) -> None:
        for request_id in sorted(self._abort_pending):
            req = self._requests.get(request_id)
            if req is None or req.is_finished:
                continue
            for seq in req.live_sequences():
                self._finish_sequence(seq, RequestStatus.FINISHED_ABORTED, outputs)
        self._abort_pending.clear()

    def _schedule(self) -> None:
        """FIFO admission; a request needs one slot per sequence (a lone request always fits)."""
        used = sum(len(r.live_sequences()) for r in self._running)
        while self._waiting:
            req = self._waiting[0]
            if self._running and used + len(req.sequences) > self.max_num_seqs:
                break
            self._waiting.popleft()
            req.status = RequestStatus.RUNNING
            for seq in req.sequences:
                seq.status = RequestStatus.RUNNING
            self._running.append(req)
            used += len(req.sequences)

    def _run(self, outputs: dict[str, RequestOutput]) -> tuple[list[Sequence], list[torch.Tensor]]:
        rows: list[Sequence] = []
        logits: list[torch.Tensor] = []
        tokens = 0
        for req in self._running:
            if req.is_finished:
                continue
            try:
                for seq in req.live_sequences():
                    ids = self.runner.input_ids_for(seq.key, seq.prompt_ids, seq.output_ids)
                    logits.append(self.runner.forward(seq.key, ids))
                    rows.append(seq)
                    tokens += len(ids)
            except Exception as e:  # NOTE: the edge: this request fails, the loop goes on.
                _log_failure("forward", req.request_id, e)
                keep = [i for i, s in enumerate(rows) if s.request_id != req.request_id]
                rows, logits = [rows[i] for i in keep], [logits[i] for i in keep]
                self._fail(req, ENGINE_ERROR, "the model failed on this request", outputs)
        self._last_step_tokens = tokens
        return rows, logits

    def _sample_and_postprocess(
        self,
        rows: list[Sequence],
        logits: list[torch.Tensor],
        outputs: dict[str, RequestOutput],
    ) -> None:
        try:
            result = self.sampler.sample(torch.stack(logits), rows)
            picks = list(zip(rows, result.token_ids, result.logprobs, strict=True))
        except Exception:  # a bad row must not sink the batch: retry row by row to find it
            picks = []
            for seq, row_logits in zip(rows, logits, strict=True):
                try:
                    one = self.sampler.sample(row_logits.unsqueeze(0), [seq])
                    picks.append((seq, one.token_ids[0], one.logprobs[0]))
                except Exception as e:
                    _log_failure("sampling", seq.request_id, e)
                    req = self._requests[seq.request_id]
                    self._fail(req, ENGINE_ERROR, "sampling failed for this request", outputs)
        for seq, token_id, logprob in picks:
            if seq.status.is_finished:
                continue
            try:
                self._postprocess(seq, token_id, logprob, outputs)
            except Exception as e:
                _log_failure("decoding", seq.request_id, e)
                req = self._requests[seq.request_id]
                self._fail(req, ENGINE_ERROR, "decoding failed for this request", outputs)

    def _postprocess(
        self,
        seq: Sequence,
        token_id: int,
        logprob: dict[str, Any] | None,
        outputs: dict[str, RequestOutput],
    ) -> None:
        seq.append_token(token_id, logprob)
        self._generated_total += 1
        status = check_stop(seq, token_id, self.stop_ctx)
        if status is not None:
            self._finish_sequence(seq, status, outputs)
            return
        event = seq.take_text_event()
        if event is not None:
            self._out(outputs, seq.request_id).events.append(event)

    def _finish_sequence(
        self, seq: Sequence, status: RequestStatus, outputs: dict[str, RequestOutput]
    ) -> None:
        seq.status = status
        out = self._out(outputs, seq.request_id)
        if status != RequestStatus.FINISHED_ABORTED:
            seq.flush_text()
            event = seq.take_text_event()
            if event is not None:
                out.events.append(event)
        out.events.append(
            protocol.finish_event(seq.index, FINISH_REASON[status], seq.num_output_tokens)
        )
        self.runner.free(seq.key)

    def _fail(
        self, req: Request, code: str, message: str, outputs: dict[str, RequestOutput]
    ) -> None:
        if req.status == RequestStatus.FINISHED_ERROR:  # one error line per request
            return
        for seq in req.sequences:
            seq.status = RequestStatus.FINISHED_ERROR
            self.runner.free(seq.key)
        req.status = RequestStatus.FINISHED_ERROR
        out = self._out(outputs, req.request_id)
        out.events.append(protocol.error_event(code, message))
        out.finished = True

    def _retire(self, outputs: dict[str, RequestOutput]) -> None:
        """Requests whose sequences are all done leave the engine; a normal end sends usage."""
        for req in list(self._requests.values()):
            if req.status != RequestStatus.FINISHED_ERROR:
                if req.live_sequences():
                    continue
                req.status = max(s.status for s in req.sequences)
                out = self._out(outputs, req.request_id)
                out.events.append(protocol.usage_event(len(req.prompt_ids), req.completion_tokens))
                out.finished = True
            del self._requests[req.request_id]
        self._running = [r for r in self._running if not r.is_finished]
        if any(r.is_finished for r in self._waiting):
            self._waiting = deque(r for r in self._waiting if not r.is_finished)
