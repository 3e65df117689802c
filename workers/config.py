"""A worker's settings, validated once; the CLI and tests both build one of these."""

from __future__ import annotations

from dataclasses import dataclass

from wire.limits import MAX_BODY_BYTES, worker_body_limit
from workers.fair_policy import SCHEDULINGS
from workers.kv_cache import DEFAULT_KV_CACHE_MEMORY, parse_bytes
from workers.speculative import DEFAULT_MODE, DEFAULT_SPEC_TOKENS, MODES

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# The step-time target a device gets unless one is set (None: off, prefill fills the token
# budget). On a CPU a step's time grows with its tokens, and chunks cut to fit keep the decodes'
# pace. On CUDA a small model's step is bound by the host launching its kernels (SmolLM2-135M's
# shapes on an H200: 1,531 kernels, the GPU busy 3 ms of a 40 ms step), its time hardly moves
# with its tokens, and a fit that prices tokens starves prefill: measured there, 0.35x the
# throughput of the fixed budget at c=64 and a TTFT p50 of 2.2 s against 0.27 (README).
STEP_TIME_TARGETS: dict[str, float | None] = {"cpu": 0.05, "cuda": None}


def default_step_time_target(device: str) -> float | None:
    """The target for a resolved device ("cpu" or "cuda") when the settings name none."""
    return STEP_TIME_TARGETS.get(device)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """`model` None or "default" is the built-in SmolLM2-135M-Instruct; else a local HF folder."""

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8001
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    scheduling: str = "fair"  # fair | fcfs: who starts next, who yields (fair_policy.py)
    # a step's prefill is cut so the step ends within this (decodes keep their cadence); the
    # token budget above stays the cap. 0: prefill takes what the fixed budget leaves; None: the
    # device's default (STEP_TIME_TARGETS)
    step_time_target_s: float | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None  # wins over kv_cache_memory when set
    kv_cache_memory: str = DEFAULT_KV_CACHE_MEMORY
    # never below what a gateway with the default limit forwards (its --max-body-bytes)
    max_body_bytes: int = worker_body_limit(MAX_BODY_BYTES)
    # a response format's or forced tool call's grammar must compile within this (else a 400)
    grammar_timeout_s: float = 5.0
    # prompt-lookup speculative decoding of greedy sequences (workers/speculative.py), or off
    speculative: str = DEFAULT_MODE
    spec_tokens: int = DEFAULT_SPEC_TOKENS  # most draft tokens verified per sequence and step

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be between 0 and 65535, not {self.port}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, not {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, not {self.num_kv_blocks}")
        if self.step_time_target_s is not None and not self.step_time_target_s >= 0:
            raise ValueError(
                f"step_time_target_s must be 0 (off) or positive, not {self.step_time_target_s}"
            )
        if not self.grammar_timeout_s > 0:
            raise ValueError(f"grammar_timeout_s must be positive, not {self.grammar_timeout_s}")
        parse_bytes(self.kv_cache_memory)  # raises ValueError on a bad size
        if self.speculative not in MODES:
            raise ValueError(
                f"speculative must be one of {', '.join(MODES)}, not {self.speculative!r}"
            )
        if self.scheduling not in SCHEDULINGS:
            raise ValueError(
                f"scheduling must be one of {', '.join(SCHEDULINGS)}, not {self.scheduling!r}"
            )
        if self.spec_tokens < 1:
            raise ValueError(f"spec_tokens must be at least 1, not {self.spec_tokens}")

    def engine_kwargs(self, device: str = "cpu") -> dict[str, object]:
        """The engine's sizing, as `Engine(...)` keyword arguments, for the resolved `device`."""
        target = self.step_time_target_s
        if target is None:
            target = default_step_time_target(device)
        return {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "scheduling": self.scheduling,
            "step_time_target_s": target or None,
            "block_size": self.block_size,
            "num_kv_blocks": self.num_kv_blocks,
            "kv_cache_memory": self.kv_cache_memory,
            "speculative": self.speculative,
            "spec_tokens": self.spec_tokens,
        }
