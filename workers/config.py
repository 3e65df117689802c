"""A worker's settings, validated once; the CLI and tests both build one of these."""

from __future__ import annotations

from dataclasses import dataclass

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """`model` None or "default" is the built-in SmolLM2-135M-Instruct; else a local HF folder."""

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8001
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 32

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be between 0 and 65535, not {self.port}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, not {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, not {self.max_num_seqs}")
