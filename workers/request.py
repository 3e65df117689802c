"""A request in the engine: a small state machine over one prompt and its `n` sequences.

The status enum is ordered so "finished" is one comparison, and one table maps a terminal status
to the finish reason on the wire. A sequence also keeps what it has generated but not yet sent
(text released by the stop-string hold-back, the tokens it carries, their logprobs), so every text
line carries exactly the tokens generated since the previous one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from workers import api
from workers.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from workers.detokenizer import IncrementalDetokenizer
    from workers.stop import StopStringHoldback


class RequestStatus(enum.IntEnum):
    """Everything after RUNNING is terminal."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4
    FINISHED_ERROR = 5

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.RUNNING


FINISH_REASON: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """What the engine is asked to run: an already tokenized prompt and its parameters."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(slots=True, eq=False)
class SequenceState:
    """One choice (`index`) of a request: its tokens, its text pipeline and its unsent output."""

    request_id: str
    index: int
    params: SamplingParams
    prompt_ids: list[int]
    max_tokens: int
    detokenizer: IncrementalDetokenizer
    holdback: StopStringHoldback
    generator: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # paged KV state, owned by the block manager and the scheduler
    all_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_hashed_blocks: int = 0
    last_token_step: int = -1  # the engine step that produced the latest token
    hit_stop_string: bool = False
    unsent_text: list[str] = field(default_factory=list)
    unsent_tokens: int = 0
    unsent_logprobs: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.all_ids:
            self.all_ids = list(self.prompt_ids)

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.index)

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output tokens: what the KV cache must hold."""
        return self.all_ids

    @property
    def num_uncomputed(self) -> int:
        return len(self.all_ids) - self.num_computed_tokens

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    def append_token(self, token_id: int, logprob: dict[str, Any] | None) -> None:
        self.output_ids.append(token_id)
        self.all_ids.append(token_id)
        self.unsent_tokens += 1
        if logprob is not None:
            self.unsent_logprobs.append(logprob)

    def push_text(self, token_id: int) -> bool:
        """Detokenize `token_id` and hold back stop-string prefixes; True on a stop-string hit."""
        released, hit = self.holdback.push(self.detokenizer.push(token_id))
        if released:
            self.unsent_text.append(released)
        self.hit_stop_string = hit
        return hit

    def flush_text(self) -> None:
        """The sequence ended without a stop string: release what was held.

        After a stop string nothing is released: bytes still in the detokenizer come after it.
        """
        if self.hit_stop_string:
            return
        released, hit = self.holdback.push(self.detokenizer.flush())
        if not hit:
            released += self.holdback.flush()
        if released:
            self.unsent_text.append(released)

    def take_text_event(self) -> api.TextLine | None:
        """A `text` line with everything released since the last one, or None if no text."""
        if not self.unsent_text:
            return None
        text = "".join(self.unsent_text)
        logprobs = self.unsent_logprobs if self.params.logprobs else None
        event = api.TextLine(self.index, text, self.unsent_tokens, logprobs)
        self.unsent_text, self.unsent_tokens, self.unsent_logprobs = [], 0, []
        return event


@dataclass(slots=True, eq=False)
class Request:
    """A prompt and its `n` sequences; finished when every sequence is."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sequences: list[SequenceState]
    status: RequestStatus = RequestStatus.WAITING
    admitted: bool = False  # the `admitted` line was sent (once: not again after a preemption)
    unforked: list[SequenceState] = field(default_factory=list)  # choices yet to start

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def live_sequences(self) -> list[SequenceState]:
        return [s for s in self.sequences if not s.status.is_finished]

    @property
    def completion_tokens(self) -> int:
        return sum(s.num_output_tokens for s in self.sequences)
