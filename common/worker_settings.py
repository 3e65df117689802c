"""A worker's settings: the `WorkerConfig` schema, its flags, and the loader `sluice worker` runs.

Torch-free on purpose: `sluice serve` checks its `[worker]` table and engine flags against this
schema and hands them to the workers it starts on their command lines
(gateway/backends/local_worker.py), without importing the workers package. The engine's own
modules take their defaults from here (workers/config.py, kv_cache.py, speculative.py).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from common.config import ConfigError, Setting, build, config_file, describe, resolve
from wire.limits import MAX_BODY_BYTES, worker_body_limit

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULINGS = ("fair", "fcfs")  # who starts next, who yields (workers/fair_policy.py)
SPECULATIVE_MODES = ("off", "prompt-lookup")  # workers/speculative.py
DEFAULT_SPECULATIVE = "prompt-lookup"
DEFAULT_SPEC_TOKENS = 6
DEFAULT_KV_CACHE_MEMORY = "2GiB"
# The step-time target a device gets unless one is set (None: off, prefill fills the token
# budget). On a CPU a step's time grows with its tokens, and chunks cut to fit keep the decodes'
# pace. On CUDA a small model's step is bound by the host launching its kernels (SmolLM2-135M's
# shapes on an H200: 1,531 kernels, the GPU busy 3 ms of a 40 ms step), its time hardly moves
# with its tokens, and a fit that prices tokens starves prefill: measured there, 0.35x the
# throughput of the fixed budget at c=64 and a TTFT p50 of 2.2 s against 0.27.
STEP_TIME_TARGETS: dict[str, float | None] = {"cpu": 0.05, "cuda": None}
# The engine's settings: what `sluice serve` passes to its local workers (its `[worker]` table);
# the rest of a worker's settings the gateway sets from its own (model, device, dtype, …).
ENGINE_KEYS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "step_time_target_s",
    "block_size",
    "num_kv_blocks",
    "kv_cache_memory",
    "grammar_timeout_s",
    "speculative",
    "spec_tokens",
)
# the engine settings `sluice serve` also takes as flags
SERVE_ENGINE_FLAGS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_memory",
    "speculative",
    "spec_tokens",
)
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' → bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (try '2GiB' or '512MiB')")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def default_step_time_target(device: str) -> float | None:
    """The target for a resolved device ("cpu" or "cuda") when the settings name none."""
    return STEP_TIME_TARGETS.get(device)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """`model` None or "default" is the built-in SmolLM2-135M-Instruct; else a local HF folder."""

    model: str | None = "default"
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
    speculative: str = DEFAULT_SPECULATIVE
    spec_tokens: int = DEFAULT_SPEC_TOKENS  # most draft tokens verified per sequence and step
    otlp_endpoint: str | None = None  # generate calls' spans (workers/tracing.py); None: off
    # decode-only steps replay captured CUDA graphs (workers/decode_graphs.py); a CPU ignores it
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be between 0 and 65535, not {self.port}")
        for name, allowed in (
            ("device", DEVICES),
            ("dtype", DTYPES),
            ("speculative", SPECULATIVE_MODES),
            ("scheduling", SCHEDULINGS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name} must be one of {', '.join(allowed)}, not {getattr(self, name)!r}"
                )
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
        if self.spec_tokens < 1:
            raise ValueError(f"spec_tokens must be at least 1, not {self.spec_tokens}")
        check_otlp_endpoint(self.otlp_endpoint)

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
            "cuda_graphs": self.cuda_graphs,
        }


# Each setting's flag and argparse keywords, by key (the WorkerConfig field, its `dest`). No
# defaults here: the loader fills what no flag gave from the environment, the file, the dataclass.
_FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "model": (
        "--model",
        {"help": "local Hugging Face model folder, or 'default' (SmolLM2-135M-Instruct)"},
    ),
    "port": ("--port", {"type": int, "help": "port to listen on (required)"}),
    "host": ("--host", {"help": "address to bind"}),
    "device": (
        "--device",
        {"choices": DEVICES, "help": "where the model runs (auto: cuda if present)"},
    ),
    "dtype": (
        "--dtype",
        {
            "choices": DTYPES,
            "help": "the weights' and activations' type (auto: bf16 where the hardware has it "
            "natively, else fp16 on CUDA, fp32 on CPU)",
        },
    ),
    "max_body_bytes": (
        "--max-body-bytes",
        {
            "type": int,
            "help": "largest request body; a gateway starting this worker sets it from its own "
            "limit",
        },
    ),
    "scheduling": (
        "--scheduling",
        {
            "choices": SCHEDULINGS,
            "help": "fair: waiting requests go by tier, then by tenant under weighted fair "
            "sharing, and a running one may yield to them; fcfs: arrival order, nothing yields",
        },
    ),
    "max_num_seqs": (
        "--max-num-seqs",
        {"type": int, "help": "sequences running at once; the rest wait (in scheduling order)"},
    ),
    "max_num_batched_tokens": (
        "--max-num-batched-tokens",
        {"type": int, "help": "token budget of one engine step (decodes plus prefill chunks)"},
    ),
    "step_time_target_s": (
        "--step-time-target",
        {
            "type": float,
            "help": "seconds one engine step should take: prefill chunks shrink so decodes keep "
            "their pace (0: prefill fills the token budget; unset: 0.05 on CPU, 0 on CUDA)",
        },
    ),
    "block_size": ("--block-size", {"type": int, "help": "tokens per KV block"}),
    "num_kv_blocks": (
        "--num-kv-blocks",
        {"type": int, "help": "exact number of KV blocks (instead of kv-cache-memory)"},
    ),
    "kv_cache_memory": (
        "--kv-cache-memory",
        {"help": "memory for the paged KV cache, e.g. 2GiB (capped at what max-num-seqs can use)"},
    ),
    "grammar_timeout_s": (
        "--grammar-timeout",
        {
            "type": float,
            "help": "seconds a response format's or forced tool call's grammar may take to compile",
        },
    ),
    "speculative": (
        "--speculative",
        {
            "choices": SPECULATIVE_MODES,
            "help": "speculative decoding of greedy requests: drafts looked up in the prompt and "
            "output so far, verified in one forward pass (off: one token per step)",
        },
    ),
    "spec_tokens": (
        "--spec-tokens",
        {"type": int, "help": "most draft tokens a sequence verifies per step"},
    ),
    "cuda_graphs": (
        "--cuda-graphs",
        {
            "action": argparse.BooleanOptionalAction,
            "help": "on CUDA, run decode-only steps as captured CUDA graphs, padded to batch and "
            "context buckets (--no-cuda-graphs: every step eager); a CPU ignores it",
        },
    ),
    "otlp_endpoint": (
        "--otlp-endpoint",
        {
            "metavar": "URL",
            "help": "export a span per generate call (OTLP/HTTP to URL/v1/traces), a child of "
            "the caller's traceparent; a gateway starting this worker passes its own",
        },
    ),
}
_KV_SIZING = ("num_kv_blocks", "kv_cache_memory")  # one or the other


def add_engine_arguments(parser: argparse.ArgumentParser, keys: Sequence[str]) -> None:
    """The flags of the engine settings `keys` (each `dest` its key), as the worker and
    `sluice serve` both spell them."""
    kv: Any = None
    for key in keys:
        flag, kwargs = _FLAGS[key]
        if key in _KV_SIZING:
            kv = kv or parser.add_mutually_exclusive_group()
        (kv if key in _KV_SIZING else parser).add_argument(flag, dest=key, **kwargs)


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """Every `sluice worker` flag; none has a default, so the loader can tell a flag given."""
    parser.add_argument(
        "--config", metavar="FILE", help="TOML file with any of these settings (keys: their names)"
    )
    for key in (
        *("model", "port", "host", "device", "dtype", "max_body_bytes", "scheduling"),
        *("otlp_endpoint", "cuda_graphs"),
    ):
        flag, kwargs = _FLAGS[key]
        parser.add_argument(flag, dest=key, **kwargs)
    add_engine_arguments(parser, ENGINE_KEYS)


def worker_parser(prog: str = "sluice worker") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Serve one model over the worker API until SIGTERM/SIGINT."
    )
    add_worker_arguments(parser)
    return parser


def worker_settings() -> list[Setting]:
    """Each WorkerConfig field with its flag, variable and help (common/config.py)."""
    return describe(WorkerConfig, worker_parser())


def check_otlp_endpoint(url: str | None) -> None:
    """An OTLP/HTTP endpoint is a base URL (`http://collector:4318`); None: tracing is off."""
    if url is not None and not url.startswith(("http://", "https://")):
        raise ValueError(f"otlp_endpoint must be an http(s) URL, not {url!r}")


def check_kv_sizing(values: Mapping[str, Any], where: str) -> None:
    """The KV cache is sized by memory or by block count; both given is a mistake."""
    if all(key in values for key in _KV_SIZING):
        raise ConfigError(f"{where}: set kv_cache_memory or num_kv_blocks, not both")


def load_worker_config(
    argv: Sequence[str] | None, environ: Mapping[str, str], prog: str = "sluice worker"
) -> WorkerConfig:
    """`sluice worker`'s settings: flags, then `SLUICE_<FLAG>`, then the `--config` file, then
    the defaults. ConfigError (argparse's SystemExit for a bad flag) when they cannot be used."""
    parser = worker_parser(prog)
    flags = vars(parser.parse_args(argv))
    table, where = config_file(flags, environ)
    values = resolve(describe(WorkerConfig, parser), flags, environ, table, where)
    if "port" not in values:
        raise ConfigError("--port is required (or SLUICE_PORT, or port in the config file)")
    check_kv_sizing(values, where)
    return build(WorkerConfig, values)


def worker_command_flags(values: Mapping[str, Any]) -> list[str]:
    """Engine settings as a worker's command-line flags, in a fixed order."""
    argv: list[str] = []
    for key in ENGINE_KEYS:
        if key in values:
            argv += [_FLAGS[key][0], str(values[key])]
    return argv
