"""Per-request sampling parameters, validated once where they are made.

Validation lives in `__post_init__` so every `SamplingParams` in the engine is known good; the
server turns a `ValueError` raised here into a 400 naming `field` (see `InvalidParam`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from wire.limits import MAX_N, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS


class InvalidParam(ValueError):
    """A sampling parameter is out of range; `param` is the wire field name."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParam(param, message)


@dataclass(slots=True)
class SamplingParams:
    """What the client asked for. `max_tokens=None` means up to the context length."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    # Derived, for the hot path: the sampler asks these per row every step.
    greedy: bool = field(init=False, default=False)
    has_penalties: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(self.stop_token_ids)
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", "max_tokens must be at least 1")
        _check(
            math.isfinite(self.temperature) and 0.0 <= self.temperature <= 2.0,
            "temperature",
            "temperature must be between 0 and 2",
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]")
        _check(self.top_k >= 0, "top_k", "top_k must be 0 (off) or positive")
        _check(
            self.seed is None or -(2**63) <= self.seed < 2**64, "seed", "seed must fit in 64 bits"
        )
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stops")
        _check(all(self.stop), "stop", "stop strings must not be empty")
        _check(
            all(len(s) <= MAX_STOP_CHARS for s in self.stop),
            "stop",
            f"stop strings have at most {MAX_STOP_CHARS} characters",
        )
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "ids must be >= 0")
        _check(1 <= self.n <= MAX_N, "n", f"n must be between 1 and {MAX_N}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                math.isfinite(value) and -2.0 <= value <= 2.0, name, f"{name} must be in [-2, 2]"
            )
        _check(
            0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
            "top_logprobs",
            f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}",
        )
        _check(
            self.logprobs or self.top_logprobs == 0,
            "top_logprobs",
            "top_logprobs requires logprobs to be true",
        )
        self.greedy = self.temperature == 0.0
        self.has_penalties = self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
