"""The synchronous engine: `step()` = apply aborts → schedule → run → sample → postprocess.

Single-threaded by design: only the engine loop's thread calls it (see async_engine.py), so
aborts recorded between steps take effect at the next step boundary. The scheduler owns the
queues, the block manager the KV blocks, the model runner the tensors, the live-request table
(engine_requests.py) the requests until they retire and the lines they report (one owner
each); the engine decides what happens to them, step by step.
A request's `n` choices share one prompt prefill: the first sequence computes the prompt, and when
it samples its first token the others fork from it (full blocks shared, the partial last block
copied) and sample from the same logits row. A step whose forward pass fails fails the requests
in that step; the loop goes on.
"""

from __future__ import annotations

import time
from typing import Any

import structlog
import torch

from common.worker_settings import (
    DEFAULT_KV_CACHE_MEMORY,
    DEFAULT_SPEC_TOKENS,
    DEFAULT_SPECULATIVE,
    parse_bytes,
)
from wire import api
from workers.block_manager import BlockManager, salt_hash
from workers.continuation import replay
from workers.decode_graphs import graph_plan
from workers.detokenizer import IncrementalDetokenizer, TokenTable
from workers.embedding import EmbeddingJob, declared_pooling
from workers.engine_embeddings import embedding_sequence, pool_chunks
from workers.engine_outputs import EngineStats, RequestOutput
from workers.engine_requests import LiveRequests, Outputs, output_of
from workers.fits import check_generation
from workers.host_copy import to_device
from workers.kv_cache import CacheShape, KVCache, blocks_for_budget
from workers.model_loader import context_length, eos_token_ids
from workers.model_runner import ModelRunner
from workers.request import EngineRequest, Request, RequestStatus, SequenceState
from workers.sampler import Sampler, seeded
from workers.scheduler import Scheduler
from workers.speculative import Speculator
from workers.step_time import StepBudget
from workers.stop import StopContext, StopStringHoldback, check_stop
from workers.tool_parser import ToolCallParser

log = structlog.get_logger("sluice.worker.engine")

ENGINE_ERROR = "engine_error"


def _log_failure(stage: str, request_id: str, error: Exception) -> None:
    """Context for the operator, never a stack trace (design §4)."""
    log.error(
        "request failed",
        stage=stage,
        request_id=request_id,
        error=type(error).__name__,
        detail=str(error)[:200],
    )


class Engine:
    """Continuous batching over a paged KV cache."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_num_seqs: int = 32,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 512,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory: str = DEFAULT_KV_CACHE_MEMORY,
        prefix_caching: bool = True,
        step_time_target_s: float | None = None,
        speculative: str = DEFAULT_SPECULATIVE,
        spec_tokens: int = DEFAULT_SPEC_TOKENS,
        decode_kernel: bool = True,
        scheduling: str = "fair",
        cuda_graphs: bool = True,
        static_decode: bool = False,
    ) -> None:
        """`cuda_graphs`: decode-only steps replay CUDA graphs (on CUDA); `static_decode`: they
        take the graphs' static buffers even where nothing is captured (decode_graphs.py)."""
        if max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        self.vocab_size: int = model.config.vocab_size
        self.max_model_len: int = max_model_len or context_length(model.config)
        self.max_num_seqs = max_num_seqs
        shape = CacheShape.of(model.config, next(model.parameters()).dtype)
        if num_kv_blocks is None:
            # never more than every running sequence at full context could use
            cap = max_num_seqs * -(-self.max_model_len // block_size)
            num_kv_blocks = blocks_for_budget(shape, block_size, parse_bytes(kv_cache_memory), cap)
        device = next(model.parameters()).device
        sizes = (max_num_seqs, self.max_model_len, block_size)
        graphs = graph_plan(device, cuda_graphs, static_decode, *sizes)
        self.cache = KVCache(shape, num_kv_blocks, block_size, device, scratch=graphs is not None)
        blocks = BlockManager(num_kv_blocks, block_size, prefix_caching)
        # NOTE: a prompt moves at least a block a step. Where a token costs a lot (float32 on an
        # AVX2 CPU: ~3 ms) that floor, not the target's share, sizes most chunks; a 4-token floor
        # took ITL p99/p50 from 2.05 to 1.89 under Poisson arrivals but TTFT up by 40%.
        budget = None if not step_time_target_s else StepBudget(step_time_target_s, block_size)
        self.scheduler = Scheduler(
            blocks, max_num_seqs, max_num_batched_tokens, budget, fair=scheduling == "fair"
        )
        self.runner = ModelRunner(model, self.cache, decode_kernel, graphs)
        self.table = TokenTable.from_tokenizer(tokenizer, self.vocab_size)
        self.sampler = Sampler(self.table)
        self.speculator = Speculator(speculative, spec_tokens)
        self.stop_ctx = StopContext(eos_token_ids(model, tokenizer), self.max_model_len)
        self.live = LiveRequests(self.scheduler)
        self.pooling = declared_pooling(model)  # an embedding's (embedding.py)
        self._abort_pending: dict[str, float] = {}  # request id → when the abort arrived
        self._step_index = 0
        self._last_step_ended = 0.0
        self._generated_total = 0
        self._last_step_tokens = 0

    # -- the interface --------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request. Raises ContextTooLong when it can never run here (see check_fits),
        InvalidContinuation for a continuation it could not have produced (continuation.py).
        Request ids are unique among live requests: the async loop is where that is checked."""
        assert request.request_id not in self.live, "a live request id was given again"
        params = request.params
        continuation = request.continuation
        assert not continuation or params.n == 1, "a continuation is of choice 0 alone"
        self.check_fits(len(request.prompt_ids), params.max_tokens, len(continuation))
        budget = self.max_model_len - len(request.prompt_ids)
        max_tokens = min(params.max_tokens or budget, budget)
        sequences = [
            SequenceState(
                request_id=request.request_id,
                index=i,
                params=params,
                prompt_ids=request.prompt_ids,
                max_tokens=max_tokens,
                detokenizer=IncrementalDetokenizer(self.table.text_bytes),
                holdback=StopStringHoldback(params.stop),
                generator=None if params.greedy else seeded(params.seed, i, self.runner.device),
                grammar=request.grammar.matcher() if request.grammar is not None else None,
                tool_parser=ToolCallParser() if request.parse_tools else None,
                cache_salt=salt_hash(request.cache_salt),
                shared_blocks=request.shared_prefix_len // self.cache.block_size,
                share=request.share,
            )
            for i in range(params.n)
        ]
        ended = replay(sequences[0], continuation, self.stop_ctx) if continuation else None
        req = Request(request.request_id, request.prompt_ids, params, sequences)
        req.unforked = sequences[1:]  # they fork from the first once it computed the prompt
        self.live.add(req)
        req.status = RequestStatus.RUNNING
        if ended is None:
            self.scheduler.add(sequences[0])
            return
        # NOTE: the first worker died between the last token's line and the `finish` line: end
        # at the next step boundary, without a forward pass, with the lines it would have sent.
        req.admitted = True
        out = self.live.early(req.request_id)
        out.events.append(api.AdmittedLine())
        self.live.end_sequence(sequences[0], ended, out)

    def add_embedding(self, job: EmbeddingJob) -> None:
        """Queue an input to embed (embedding.py): a prompt computed like any other, pooled
        instead of sampled; its request ends with a `pooled` line, then `usage`. Raises
        ContextTooLong when it can never run here."""
        assert job.request_id not in self.live, "a live request id was given again"
        seq = embedding_sequence(job, self.table, self.max_model_len, self.scheduler, self.pooling)
        req = Request(job.request_id, job.prompt_ids, seq.params, [seq])
        req.status = RequestStatus.RUNNING
        self.live.add(req)
        self.scheduler.add(seq)

    def check_fits(self, prompt_len: int, max_tokens: int | None, continuation: int = 0) -> None:
        """The one check that a request can run here: its prompt within the context, prompt
        plus `max_tokens` within the context, a continuation (its length given) within both,
        and one sequence of it within the KV cache."""
        check_generation(
            prompt_len, max_tokens, continuation, self.max_model_len, self.scheduler.fits
        )

    def abort(self, request_id: str, arrived_at: float | None = None) -> bool:
        """Mark a live request for abort at the next step; unknown or finished ids are a no-op.

        `arrived_at` (time.monotonic) is when the abort reached the worker, if that was before
        this call (the engine thread may have been busy with a step)."""
        if request_id not in self.live:
            return False
        arrived = time.monotonic() if arrived_at is None else arrived_at
        self._abort_pending[request_id] = min(arrived, self._abort_pending.get(request_id, arrived))
        return True

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return EngineStats(
            waiting=s.waiting,
            running=s.running,
            generated_tokens_total=self._generated_total,
            last_step_tokens=self._last_step_tokens,
            preemptions_total=sum(s.preemptions.values()),
            preemptions=s.preemptions,
            max_num_seqs=self.max_num_seqs,
            kv_blocks_used=s.kv_blocks_used,
            kv_blocks_total=s.kv_blocks_total,
            prefix_cache_hits=s.prefix_cache_hits,
            prefix_cache_queries=s.prefix_cache_queries,
            steps_total=self._step_index,
            spec_draft_tokens=self.speculator.stats.draft_tokens,
            spec_accepted_tokens=self.speculator.stats.accepted_tokens,
        )

    def apply_aborts(self) -> list[RequestOutput]:
        """Stop the sequences whose abort arrived since the last step now, so their
        confirmations go out at this step boundary rather than after the next forward."""
        outputs = self.live.begin()
        self._apply_aborts(outputs)
        return self.live.retire(outputs)

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; return the events it produced."""
        outputs = self.live.begin()
        self._apply_aborts(outputs)
        self._step_index += 1
        scheduled = self.scheduler.schedule()
        spare = self.scheduler.spare_tokens(scheduled)  # drafts count against the target too
        scheduled.drafts = self.speculator.extend(scheduled.work, self.scheduler, spare)
        self._last_step_tokens = scheduled.num_tokens
        self._report_admissions(scheduled.work, outputs)
        if scheduled.work:
            try:
                result = self.runner.execute(scheduled.work)
            except Exception as e:  # NOTE: the edge: this step's requests fail, the loop goes on.
                for request_id in {s.request_id for s, _ in scheduled.work}:
                    _log_failure("forward", request_id, e)
                    self.live.fail(
                        request_id, ENGINE_ERROR, "the model failed on this request", outputs
                    )
            else:
                # a draft's tokens count as computed once verified (Speculator.settle)
                self.scheduler.computed([(s, n) for s, n in scheduled.work if not s.draft])
                self._sample_and_postprocess(result.samplers, result.logits, outputs)
                pool_chunks(result, self.live, outputs)
                scheduled.replayed = result.replayed
                # NOTE: a step that captured a graph took its warm-ups and capture too: it is
                # neither a replay's time nor an eager step's, so the budget learns nothing
                if not result.captured:
                    self.scheduler.step_ended(scheduled)  # the sampled tokens are on the host now
        self.speculator.discard()  # the drafts of sequences that failed in this step
        self._last_step_ended = time.monotonic()
        return self.live.retire(outputs)

    def fail_all(self, code: str, message: str) -> list[RequestOutput]:
        """Fail every live request (engine-wide fault or shutdown)."""
        outputs = self.live.begin()
        for request_id in self.live.ids():
            self.live.fail(request_id, code, message, outputs)
        return self.live.retire(outputs)

    # -- one step -------------------------------------------------------------------------------

    def _apply_aborts(self, outputs: Outputs) -> None:
        """Stop aborted sequences at this step boundary and report what each abort cost.

        NOTE: an abort that arrived while the previous step ran could not stop it; the tokens
        that step gave the sequence are its tail.
        """
        now = time.monotonic()
        for request_id, arrived in sorted(self._abort_pending.items()):
            req = self.live.get(request_id)
            if req is None or req.status.is_finished:
                continue
            for seq in req.live_sequences():
                in_flight = arrived < self._last_step_ended and seq.last_token_step == (
                    self._step_index
                )
                seq.status = RequestStatus.FINISHED_ABORTED
                output_of(outputs, request_id).events.append(
                    api.abort_line(
                        seq.index,
                        seq.num_output_tokens,
                        seq.last_step_tokens if in_flight else 0,
                        max(0.0, now - arrived),
                    )
                )
                self.live.release(seq)
        self._abort_pending.clear()

    def _report_admissions(self, work: list[tuple[SequenceState, int]], outputs: Outputs) -> None:
        """The first time a request is scheduled it has left the queue: say so, before any text.

        NOTE: once per request; a preempted sequence scheduled again, or a choice forked or
        scheduled after its leader, belongs to a request already admitted."""
        for seq, _ in work:
            req = self.live[seq.request_id]
            if not req.admitted:
                req.admitted = True
                output_of(outputs, req.request_id).events.append(api.AdmittedLine())

    def _fork_children(self, leader: SequenceState) -> list[SequenceState]:
        """The leader just computed the prompt: its siblings start from its KV."""
        req = self.live[leader.request_id]
        forked = []
        for child in req.unforked:
            fork = self.scheduler.fork(leader, child)
            if fork.copy is not None:
                self.cache.copy_block(*fork.copy)
            if fork.running:
                forked.append(child)
        req.unforked = []
        return forked

    def _sample_and_postprocess(
        self, samplers: list[SequenceState], logits: torch.Tensor, outputs: Outputs
    ) -> None:
        """Sample every row (a sequence verifying a draft has one per position), then hand each
        sequence its tokens: one sampled, or a verified draft's accepted ones."""
        rows, row_index, offset = [], [], 0
        for seq in samplers:
            width = 1 + len(seq.draft)
            if not seq.status.is_finished:
                rows += [seq] * width
                row_index += range(offset, offset + width)
                if seq.index == 0 and not seq.output_ids and seq.params.n > 1:
                    for child in self._fork_children(seq):
                        rows.append(child)
                        row_index.append(offset)
            offset += width
        if not rows:
            return
        if row_index != list(range(offset)):
            logits = logits[to_device(row_index, logits.device)]
        try:
            result = self.sampler.sample(logits, rows)
        except Exception as e:  # a bad row must not sink the batch: fail the requests in it
            for request_id in {s.request_id for s in rows}:
                _log_failure("sampling", request_id, e)
                self.live.fail(
                    request_id, ENGINE_ERROR, "sampling failed for this request", outputs
                )
            return
        i = 0
        while i < len(rows):
            seq, width = rows[i], 1 + len(rows[i].draft)
            tokens, logprobs = result.token_ids[i : i + width], result.logprobs[i : i + width]
            i += width
            if seq.status.is_finished:
                continue
            try:
                if seq.draft:
                    tokens = self.speculator.settle(seq, tokens, self.scheduler)
                self._postprocess(seq, tokens, logprobs, outputs)
            except Exception as e:
                _log_failure("decoding", seq.request_id, e)
                self.live.fail(
                    seq.request_id, ENGINE_ERROR, "decoding failed for this request", outputs
                )

    def _postprocess(
        self,
        seq: SequenceState,
        tokens: list[int],
        logprobs: list[dict[str, Any] | None],
        outputs: Outputs,
    ) -> None:
        """Append the step's tokens one by one until one ends the sequence; what follows that
        one (the rest of a verified draft) is dropped, never streamed or counted."""
        seq.last_token_step = self._step_index
        seq.last_step_tokens = 0
        for token_id, logprob in zip(tokens, logprobs, strict=False):
            seq.append_token(token_id, logprob)
            seq.last_step_tokens += 1
            self._generated_total += 1
            status = check_stop(seq, token_id, self.stop_ctx)
            if status is not None:
                self._finish_sequence(seq, status, outputs)
                return
        events = seq.take_events()
        if events:
            output_of(outputs, seq.request_id).events.extend(events)

    def _finish_sequence(self, seq: SequenceState, status: RequestStatus, outputs: Outputs) -> None:
        out = output_of(outputs, seq.request_id)
        seq.flush_text()
        out.events.extend(seq.take_events())
        self.live.end_sequence(seq, status, out)
