"""A private `redis-server` on a port of its own, for tests that kill, hang and restart it."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from gateway.backends.local_worker import free_port
from testkit.probes import redis_answers


class PrivateRedis:
    """`redis-server` keeping nothing on disk; a restart comes back empty, as such a Redis does."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                *("redis-server", "--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no", "--dir", str(self.workdir)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not self.answers():
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)  # NOTE: polling another process's start, with a deadline

    def answers(self) -> bool:
        return redis_answers(self.port)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            self.proc.wait(10)
