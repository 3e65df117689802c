"""An embedding's part in the engine's steps: its sequence, and its chunks' pooling.

An input to embed is a sequence like a prompt's (the scheduler gives it chunks under the step's
token budget and time target, the block manager its KV blocks), with a `Pool` (the model's
declared pooling, embedding.py) instead of a sampler: the model runner hands back its chunks'
final hidden states, added here to the pool as each step ends; once its last token is computed
the request ends with the vector (a `pooled` line), its `finish` line and `usage` (prompt
tokens, none generated).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wire.sampling_params import SamplingParams
from workers.detokenizer import IncrementalDetokenizer, TokenTable
from workers.embedding import EmbeddingJob, Pool, PooledLine
from workers.engine_requests import LiveRequests, Outputs, output_of
from workers.fits import check_embedding
from workers.request import RequestStatus, SequenceState
from workers.stop import StopStringHoldback

if TYPE_CHECKING:
    from workers.model_runner import StepResult
    from workers.scheduler import Scheduler

POOLED_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)  # never sampled


def embedding_sequence(
    job: EmbeddingJob, table: TokenTable, max_model_len: int, scheduler: Scheduler, pooling: str
) -> SequenceState:
    """The sequence that computes `job`'s input; ContextTooLong (naming `input`) when it can
    never run here."""
    check_embedding(len(job.prompt_ids), max_model_len, scheduler.fits)
    return SequenceState(
        request_id=job.request_id,
        index=0,
        params=POOLED_PARAMS,
        prompt_ids=job.prompt_ids,
        max_tokens=0,
        detokenizer=IncrementalDetokenizer(table.text_bytes),
        holdback=StopStringHoldback(()),
        generator=None,
        embedding=Pool(pooling, job.dimensions),
        share=job.share,
    )


def pool_chunks(result: StepResult, live: LiveRequests, outputs: Outputs) -> None:
    """Add the step's embedding chunks to their pools; an input whose last token this step
    computed ends with its vector."""
    if not result.pooled:
        return
    assert result.hidden is not None, "embedding chunks ran without their hidden states"
    offset = 0
    for seq, first, new in result.pooled:
        rows = result.hidden[offset : offset + new]
        offset += new
        if seq.status.is_finished or seq.embedding is None:  # aborted meanwhile
            continue
        seq.embedding.add(rows, first)
        if seq.num_computed_tokens < len(seq.prompt_ids):
            continue
        out = output_of(outputs, seq.request_id)
        out.events.append(PooledLine(seq.embedding.vector(seq.prompt_len)))
        live.end_sequence(seq, RequestStatus.FINISHED_STOPPED, out)
