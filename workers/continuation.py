"""Continuing a run another worker started, from its exact token.

When a worker dies mid-stream the gateway resubmits the request elsewhere with the ids of the
tokens the dead worker had streamed (`continuation`, docs/worker-api.md). They are replayed
through the sequence's own pipeline, as if this worker had sampled them: each counts against
`max_tokens` and in the penalties, advances the grammar, and goes through the detokenizer, the
stop-string hold-back and the tool-call parser. What the replay releases was already sent and is
dropped (released tool calls still count, so call indexes go on), and so are the replayed tokens'
ids: the next line carries only tokens generated here. What the first worker held back (a
stop-string prefix, part of a code point) stays held and comes out when it would have. The KV
cache is not replayed: the sequence's prompt plus continuation is prefilled as one.
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.engine_outputs import InvalidContinuation
from workers.request import RequestStatus, SequenceState
from workers.stop import StopContext, check_stop


def replay(
    seq: SequenceState, continuation: Sequence[int], ctx: StopContext
) -> RequestStatus | None:
    """Prime a sequence that has generated nothing with `continuation`; the status when its
    last token already ended the run (the first worker died before its `finish` line).

    Raises InvalidContinuation, leaving `seq` unusable, for ids this run could not have made:
    a token its grammar refuses, or any token after the one that ended it.
    """
    if seq.grammar is not None and not seq.grammar.accepts(continuation):
        raise InvalidContinuation("the continuation does not follow the request's grammar")
    status = None
    for i, token_id in enumerate(continuation):
        if status is not None:
            raise InvalidContinuation(f"continuation[{i - 1}] already ended the sequence")
        seq.append_token(token_id, None)
        status = check_stop(seq, token_id, ctx)
    if status is not None:
        # NOTE: the first worker flushed in the step of the last token, onto the line that
        # carried its id: that line was received, or the id would not be here.
        seq.flush_text()
    seq.drop_unsent()
    return status
