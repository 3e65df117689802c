"""Request limits shared by the gateway's validation and the worker's (one source for both).

Torch-free on purpose: the gateway imports it without loading any model code.
"""

from __future__ import annotations

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 4  # OpenAI's limit
# NOTE: every token is checked against each stop string's prefixes while text is held back, so
# an unbounded stop string would make one request as slow as it likes.
MAX_STOP_CHARS = 512
MAX_BODY_BYTES = 4 * 1024 * 1024  # the gateway's default request body limit
# What a generate body adds to the client's messages and stops: the request id and parameters.
# Re-encoding never grows the rest (escapes stay escapes; an escaped non-ASCII character becomes
# its shorter UTF-8 bytes).
_GENERATE_OVERHEAD = 64 * 1024
# A run continued on another worker carries the token ids generated so far (adapters/pool.py):
# at most 8 bytes each (seven digits and a comma), for runs up to this many tokens.
CONTINUED_TOKENS = 128 * 1024
_CONTINUATION_OVERHEAD = 8 * CONTINUED_TOKENS


def worker_body_limit(gateway_max_body: int) -> int:
    """The body limit a worker needs so that whatever the gateway accepts also fits there,
    continuation included."""
    return gateway_max_body + _GENERATE_OVERHEAD + _CONTINUATION_OVERHEAD


# NOTE: what an error message repeats of a request is cut to this: a value can be megabytes, or a
# credential pasted into the wrong field. The gateway's messages and the workers' (which reach
# clients through the gateway) both use it.
SHOWN_CHARS = 40


def shown(text: str) -> str:
    """A string from the request as an error message may repeat it: quoted, control characters
    escaped, and cut to its first `SHOWN_CHARS` characters (`…` marks a cut)."""
    return repr(text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "…")
