"""Start, watch and stop `sluice worker` processes that the gateway owns.

Each worker is a child process; it gets SIGTERM when the gateway exits (and, on Linux, when the
gateway dies without cleaning up), so Ctrl-C or SIGTERM on `sluice serve` leaves no orphans. It
runs in a process group of its own, so a Ctrl-C in the terminal does not stop it before the
gateway has drained the runs it serves.

Its settings travel on its command line only: the gateway's model, device, dtype, body limit and
scheduling, and the engine settings `sluice serve` was given (its `[worker]` table and engine
flags). The `SLUICE_*` variables a worker would read are taken out of its environment, so one
meant for the gateway (`SLUICE_CONFIG`, `SLUICE_PORT`) never configures a worker behind its back.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib.util
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import structlog

from common.config import CONFIG_ENV
from common.worker_settings import worker_command_flags, worker_settings
from wire.limits import worker_body_limit

log = structlog.get_logger("sluice.local_worker")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _own_group_dying_with_parent() -> None:
    """Runs in the child before exec: a process group of its own (as `process_group=0`, which
    uvloop's loop does not take), and SIGTERM from the kernel when the parent dies."""
    os.setpgid(0, 0)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def worker_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without the variables that configure a worker (its settings' and
    `SLUICE_CONFIG`): what the gateway hands a worker goes on its command line."""
    settings = {s.env for s in worker_settings()} | {CONFIG_ENV}
    return {name: value for name, value in environ.items() if name not in settings}


class LocalWorker:
    """One worker child process serving `model` on a loopback port."""

    def __init__(
        self,
        model: str,
        device: str,
        dtype: str,
        max_body_bytes: int,
        port: int | None = None,
        scheduling: str = "fair",
        engine: Mapping[str, Any] | None = None,
        otlp_endpoint: str | None = None,
    ) -> None:
        """`max_body_bytes` is the gateway's own limit: the worker takes whatever it forwards;
        `scheduling` the gateway's own (fair or fcfs); `engine` the engine settings given to
        `sluice serve` (Settings.worker), the worker's defaults for the rest."""
        self.model = model
        self.scheduling = scheduling
        self.engine = dict(engine or {})
        self.otlp_endpoint = otlp_endpoint  # the gateway's: its workers' spans join its traces
        self.device = device
        self.dtype = dtype
        self.max_body_bytes = worker_body_limit(max_body_bytes)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = f"local:{self.port}"
        self._proc: asyncio.subprocess.Process | None = None

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "workers.cli",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--device",
            self.device,
            "--dtype",
            self.dtype,
            "--max-body-bytes",
            str(self.max_body_bytes),
            "--scheduling",
            self.scheduling,
            *worker_command_flags(self.engine),
            *(["--otlp-endpoint", self.otlp_endpoint] if self.otlp_endpoint else []),
        ]

    async def start(self, ready_within: float) -> None:
        """Start the process (again, after it exited) and wait until it serves; RuntimeError if
        it exits first or is not ready in time (it is stopped then)."""
        if importlib.util.find_spec("torch") is None:
            raise RuntimeError(
                "a local worker needs the worker extra (pip install 'sluicegate[worker]'); "
                "or point the gateway at workers or upstreams with --worker-url / --upstream"
            )
        log.info("starting worker", model=self.model, port=self.port)
        # NOTE: a process group of its own, so a terminal's Ctrl-C reaches the gateway only:
        # the gateway drains its runs first and stops its workers after (gateway/http/drain.py).
        self._proc = await asyncio.create_subprocess_exec(
            *self.command(),
            env=worker_environment(os.environ),
            preexec_fn=_own_group_dying_with_parent,
        )
        try:
            await self._wait_ready(ready_within)
        except RuntimeError:
            await self.stop()
            raise

    async def wait(self) -> int:
        """Until the process exits; its return code (negative: killed by that signal)."""
        assert self._proc is not None, "the worker was never started"
        return await self._proc.wait()

    async def _wait_ready(self, ready_within: float) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + ready_within
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                if self._proc.returncode is not None:
                    raise RuntimeError(f"worker exited with code {self._proc.returncode}")
                try:
                    async with session.get(
                        f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=1)
                    ) as resp:
                        if resp.status == 200:
                            log.info("worker ready", url=self.url)
                            return
                except (aiohttp.ClientError, OSError, TimeoutError):
                    pass
                await asyncio.sleep(0.2)
        raise RuntimeError(f"worker not ready after {ready_within:.0f} s")

    def kill(self) -> None:
        """SIGKILL a hung worker (SIGTERM would wait on the engine it is stuck in); its
        supervisor starts it again."""
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()

    async def stop(self, grace: float = 10.0) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            log.warning("worker did not stop in time; killing it", pid=proc.pid)
            proc.kill()
            await proc.wait()
