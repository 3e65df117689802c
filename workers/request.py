"""A request in the engine: a small state machine over one prompt and its `n` sequences.

The status enum is ordered so "finished" is one comparison, and one table maps a terminal status
to the finish reason on the wire. A sequence also keeps what it has generated but not yet sent
(text released by the stop-string hold-back, tool calls parsed out of it, the tokens they carry,
their ids and logprobs), so every line carries exactly the tokens generated since the previous one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from wire import api
from wire.sampling_params import SamplingParams
from wire.share import DEFAULT_SHARE, Share
from workers.block_manager import NO_HASH
from workers.tool_parser import ToolCall

if TYPE_CHECKING:
    import torch

    from workers.detokenizer import IncrementalDetokenizer
    from workers.embedding import Pool
    from workers.grammar import CompiledGrammar, Matcher
    from workers.speculative import NgramIndex
    from workers.stop import StopStringHoldback
    from workers.tool_parser import ToolCallParser


class RequestStatus(enum.IntEnum):
    """Everything after RUNNING is terminal."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_TOOL_CALLS = 3  # stopped, having made tool calls
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.RUNNING


FINISH_REASON: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_TOOL_CALLS: "tool_calls",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """What the engine is asked to run: an already tokenized prompt and its parameters, the
    grammar its output must follow (compiled before it gets here) and whether its text is
    parsed for tool calls. `continuation`: choice 0's tokens another worker already generated
    and streamed; the run goes on after them (Engine.add_request replays them)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    grammar: CompiledGrammar | None = None
    parse_tools: bool = False
    cache_salt: str | None = None  # prefix-cache isolation: only the same salt shares blocks
    continuation: tuple[int, ...] = ()  # only with n == 1
    # the prompt's first tokens that are a declared shared system prompt (chat.shared_prefix_len):
    # their full blocks are cached for every salt
    shared_prefix_len: int = 0
    share: Share = DEFAULT_SHARE  # its tenant, weight and tier (fair_policy.py)


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
    grammar: Matcher | None = None
    tool_parser: ToolCallParser | None = None
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # paged KV state, owned by the block manager and the scheduler
    all_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_hashed_blocks: int = 0
    cache_salt: int = NO_HASH  # the block manager's chain start (block_manager.salt_hash)
    shared_blocks: int = 0  # leading blocks hashed without the salt (block_manager.chain_parent)
    share: Share = DEFAULT_SHARE  # its request's tenant, weight and tier (fair_policy.py)
    yields: int = 0  # times it was preempted for another's priority or fair share
    last_token_step: int = -1  # the engine step that produced the latest token
    last_step_tokens: int = 0  # how many tokens that step produced (a verified draft: several)
    # prompt-lookup speculation (speculative.py): the step's draft, also at the end of all_ids
    # until it is settled, and the n-gram index it is looked up in
    draft: list[int] = field(default_factory=list)
    ngrams: NgramIndex | None = None
    hit_stop_string: bool = False
    tool_calls_sent: int = 0
    unsent: list[str | ToolCall] = field(default_factory=list)  # in order; adjacent texts merged
    unsent_ids: list[int] = field(default_factory=list)  # the tokens the next line carries
    unsent_logprobs: list[dict[str, Any]] = field(default_factory=list)
    # an embedding's input (embedding.py): a prompt that is pooled, never sampled
    embedding: Pool | None = None

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
    def prefix_cached(self) -> bool:
        """Whether its blocks come from and go to the prefix cache: not an embedding's."""
        return self.embedding is None

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
        """Record a sampled token; a grammar the sequence follows advances with it (and raises
        GrammarViolation for a token it refuses)."""
        self.output_ids.append(token_id)
        self.all_ids.append(token_id)
        self.unsent_ids.append(token_id)
        if logprob is not None:
            self.unsent_logprobs.append(logprob)
        if self.grammar is not None:
            self.grammar.consume(token_id)

    def push_text(self, token_id: int) -> bool:
        """Detokenize `token_id` and hold back stop-string prefixes; True on a stop-string hit."""
        released, hit = self.holdback.push(self.detokenizer.push(token_id))
        self._release(released)
        self.hit_stop_string = hit
        return hit

    def flush_text(self) -> None:
        """The sequence ended without a stop string: release what was held.

        After a stop string nothing is released: bytes still in the detokenizer come after it.
        A tool call still open is closed either way (tool_parser.py says how).
        """
        if not self.hit_stop_string:
            released, hit = self.holdback.push(self.detokenizer.flush())
            if not hit:
                released += self.holdback.flush()
            self._release(released)
        if self.tool_parser is not None:
            self._queue(self.tool_parser.flush())
        if self.unsent_ids and not self.unsent:
            # NOTE: the last tokens brought no text (an EOS generated as a token, a stop string's
            # own tokens): an empty line still carries their count and ids, so every token the
            # usage counts was on a line and `sent` adds up to it. Their logprobs go the way of
            # their text: OpenAI's `logprobs.content` lists the message content's tokens.
            self.unsent.append("")
            self.unsent_logprobs = []

    def _release(self, text: str) -> None:
        if not text:
            return
        self._queue([text] if self.tool_parser is None else self.tool_parser.push(text))

    def _queue(self, segments: list[str | ToolCall]) -> None:
        for segment in segments:
            if isinstance(segment, str) and self.unsent and isinstance(self.unsent[-1], str):
                self.unsent[-1] += segment
            else:
                self.unsent.append(segment)

    def drop_unsent(self) -> None:
        """Count everything so far as sent (a continuation's replay: the client has it); tool
        calls released meanwhile still take their call indexes."""
        self.take_events()
        self.unsent_ids, self.unsent_logprobs = [], []

    def take_events(self) -> list[api.TextLine | api.ToolCallLine]:
        """The lines for everything released since the last call (none if nothing was).

        NOTE: the tokens carried (their count and their ids) go on the first line, the logprobs on
        the first text line: a tool call's tokens have no logprobs on OpenAI's wire.
        """
        if not self.unsent:
            return []
        lines: list[api.TextLine | api.ToolCallLine] = []
        logprobs = self.unsent_logprobs if self.params.logprobs else None
        for segment in self.unsent:
            if isinstance(segment, str):
                lines.append(api.TextLine(segment, self.index, 0, logprobs))
                logprobs = [] if logprobs is not None else None
            else:
                call = self.tool_calls_sent
                lines.append(api.ToolCallLine(call, segment.arguments, segment.name, self.index, 0))
                self.tool_calls_sent += 1
        lines[0].tokens, lines[0].token_ids = len(self.unsent_ids), self.unsent_ids
        self.unsent, self.unsent_ids, self.unsent_logprobs = [], [], []
        return lines


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
