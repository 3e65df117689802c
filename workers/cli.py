"""`sluice worker`: serve one model over the worker API until SIGTERM/SIGINT.

gateway/cli/main.py hands `sluice worker …` to `main` here; `python -m workers.cli` runs the same
thing on its own. Its settings (flags, `SLUICE_<FLAG>` variables, a `--config` TOML file) are
loaded by common/worker_settings.py, the loader `sluice serve` uses too (common/config.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

import structlog
from aiohttp import web

from common.config import ConfigError
from common.logs import configure_logging as configure_logs

# NOTE: re-exported for the tests and deploy checks that build the worker's parser from here.
from common.worker_settings import add_worker_arguments, load_worker_config
from workers.app_keys import SERVICE
from workers.config import WorkerConfig
from workers.server import create_worker_app

__all__ = ["add_worker_arguments", "configure_logging", "main", "serve"]

log = structlog.get_logger("sluice.worker")

SHUTDOWN_TIMEOUT_S = 5.0


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


def main(argv: Sequence[str] | None = None, prog: str = "sluice worker") -> int:
    """Entry point for `sluice worker`; returns the process exit code (2: unusable settings)."""
    try:
        config = load_worker_config(argv, os.environ, prog)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    configure_logging()
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
