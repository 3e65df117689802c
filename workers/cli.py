"""`sluice worker`: serve one model over the worker API until SIGTERM/SIGINT.

`add_worker_arguments` and `run_worker` are what gateway/cli/main.py wires into the `sluice` script;
`python -m workers.cli` runs the same thing on its own. Every flag also reads `SLUICE_<FLAG>`
from the environment (flags win).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

import structlog
from aiohttp import web

from common.logs import configure_logging as configure_logs
from workers.app_keys import SERVICE
from workers.config import DEVICES, DTYPES, WorkerConfig
from workers.fair_policy import SCHEDULINGS
from workers.server import create_worker_app
from workers.speculative import MODES

log = structlog.get_logger("sluice.worker")

SHUTDOWN_TIMEOUT_S = 5.0
_DEFAULTS = WorkerConfig()  # one source for the flags' defaults


def _env(flag: str) -> str | None:
    return os.environ.get("SLUICE_" + flag.upper().replace("-", "_"))


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's flags; each defaults to its `SLUICE_<FLAG>` environment variable."""
    parser.add_argument(
        "--model",
        default=_env("model") or "default",
        help="local Hugging Face model folder, or 'default' (SmolLM2-135M-Instruct)",
    )
    port = _env("port")
    parser.add_argument(
        "--port", type=int, default=port, required=port is None, help="port to listen on"
    )
    parser.add_argument("--host", default=_env("host") or _DEFAULTS.host, help="address to bind")
    parser.add_argument(
        "--device", choices=DEVICES, default=_env("device") or "auto", help="auto: cuda if present"
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default=_env("dtype") or "auto",
        help="auto: bf16 where the hardware has it natively, else fp16 (CUDA) or fp32 (CPU)",
    )
    _add_engine_arguments(parser)


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """How the engine batches, caches and bounds its work."""
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=_env("max-num-seqs") or _DEFAULTS.max_num_seqs,
        help="sequences running at once; the rest wait (in --scheduling order)",
    )
    parser.add_argument(
        "--scheduling",
        choices=SCHEDULINGS,
        default=_env("scheduling") or _DEFAULTS.scheduling,
        help="fair: waiting requests go by tier, then by tenant under weighted fair sharing, "
        "and a running one may yield to them; fcfs: arrival order, nothing yields",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=_env("max-num-batched-tokens") or _DEFAULTS.max_num_batched_tokens,
        help="token budget of one engine step (decodes plus prefill chunks)",
    )
    parser.add_argument(
        "--step-time-target",
        type=float,
        default=float(_env("step-time-target")) if _env("step-time-target") else None,
        help="seconds one engine step should take: prefill chunks shrink so decodes keep "
        "their pace (0: prefill fills the token budget; default: 0.05 on CPU, 0 on CUDA)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=_env("block-size") or _DEFAULTS.block_size,
        help="tokens per KV block",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=int(_env("max-body-bytes") or _DEFAULTS.max_body_bytes),
        help="largest request body; a gateway starting this worker sets it from its own limit",
    )
    _add_decoding_arguments(parser)
    kv = parser.add_mutually_exclusive_group()
    kv.add_argument(
        "--kv-cache-memory",
        default=_env("kv-cache-memory") or _DEFAULTS.kv_cache_memory,
        help="memory for the paged KV cache, e.g. 2GiB (capped at what max-num-seqs can use)",
    )
    num_blocks = _env("num-kv-blocks")
    kv.add_argument(
        "--num-kv-blocks",
        type=int,
        default=int(num_blocks) if num_blocks else None,
        help="exact number of KV blocks (instead of --kv-cache-memory)",
    )


def _add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """How tokens are chosen beyond plain sampling: grammars and speculative drafts."""
    parser.add_argument(
        "--grammar-timeout",
        type=float,
        default=float(_env("grammar-timeout") or _DEFAULTS.grammar_timeout_s),
        help="seconds a response format's or forced tool call's grammar may take to compile",
    )
    parser.add_argument(
        "--speculative",
        choices=MODES,
        default=_env("speculative") or _DEFAULTS.speculative,
        help="speculative decoding of greedy requests: drafts looked up in the prompt and "
        "output so far, verified in one forward pass (off: one token per step)",
    )
    parser.add_argument(
        "--spec-tokens",
        type=int,
        default=int(_env("spec-tokens") or _DEFAULTS.spec_tokens),
        help="most draft tokens a sequence verifies per step",
    )


def configure_logging() -> None:
    """The format every sluicegate process logs in (common/logs.py), at SLUICE_LOG_LEVEL,
    unless the embedding program configured structlog already."""
    if not structlog.is_configured():
        configure_logs(os.environ.get("SLUICE_LOG_LEVEL", "info"))
    # transformers' progress bars and advice are noise in a server's log
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


async def serve(config: WorkerConfig) -> int:
    """Listen at once (503 while loading), log `worker ready`, run until a signal. Exit code."""
    app = create_worker_app(config)
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port).start()
    except OSError as e:
        log.error("cannot listen", host=config.host, port=config.port, error=e.strerror)
        await runner.cleanup()
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    service = app[SERVICE]
    waits = [asyncio.create_task(e.wait()) for e in (service.ready, service.failed, stop)]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    code = 1 if service.failed.is_set() else 0
    if service.ready.is_set() and not stop.is_set():
        port = runner.addresses[0][1]
        log.info("worker ready", host=config.host, port=port, model=service.model_info()["id"])
        await asyncio.wait(waits[1:], return_when=asyncio.FIRST_COMPLETED)
        code = 1 if service.failed.is_set() else 0
    for task in waits:
        task.cancel()
    log.info("worker stopping")
    await runner.cleanup()
    return code


def run_worker(args: argparse.Namespace) -> int:
    """Entry point for `sluice worker`; returns the process exit code."""
    configure_logging()
    try:
        config = WorkerConfig(
            model=args.model,
            host=args.host,
            port=args.port,
            device=args.device,
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            scheduling=args.scheduling,
            step_time_target_s=args.step_time_target,
            block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory=args.kv_cache_memory,
            max_body_bytes=args.max_body_bytes,
            grammar_timeout_s=args.grammar_timeout,
            speculative=args.speculative,
            spec_tokens=args.spec_tokens,
        )
    except ValueError as e:
        log.error("bad worker settings", error=str(e))
        return 2
    return asyncio.run(serve(config))


def main(argv: Sequence[str] | None = None, prog: str = "sluice worker") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_worker_arguments(parser)
    return run_worker(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
