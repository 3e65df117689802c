"""The child processes of `gateway_overhead.py`: started in sessions of their own, waited for,
measured (CPU time and resident memory from /proc) and stopped in reverse order."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TICK_S = 1 / os.sysconf("SC_CLK_TCK")
PAGE_MB = os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def _die_with_parent() -> None:
    """preexec: the child gets SIGTERM if this script dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Processes:
    """The child processes. Each runs in its own session, so Ctrl-C reaches only this script,
    which then stops them in reverse order of start."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.children: list[subprocess.Popen] = []

    def spawn(self, name: str, args: list[str], **kwargs) -> subprocess.Popen:
        log = (self.logdir / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            [sys.executable, *args],
            cwd=kwargs.pop("cwd", ROOT),
            stderr=log,
            stdout=kwargs.pop("stdout", log),
            start_new_session=True,
            preexec_fn=_die_with_parent,
            **kwargs,
        )
        self.children.append(proc)
        return proc

    def wait_ready(self, name: str, proc: subprocess.Popen, url: str) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                sys.exit(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
            time.sleep(0.05)
        sys.exit(f"{name} did not answer {url} within 30 s:\n{self.log_tail(name)}")

    def log_tail(self, name: str, lines: int = 20) -> str:
        text = (self.logdir / f"{name}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop_all(self) -> None:
        for proc in reversed(self.children):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.children):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin(upstream: int, loadgen: int, relays: list[subprocess.Popen]) -> None:
    """`--pin`: the relays on the upper half of the CPUs this process may use; the upstream, the
    load generator and this process on the lower half (every thread of each, as it is now; the
    threads they start later inherit it)."""
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    load, relaying = set(cpus[:half]), set(cpus[half:])
    for pid in (upstream, loadgen, os.getpid()):
        _pin_threads(pid, load)
    for proc in relays:
        _pin_threads(proc.pid, relaying)
    print(
        f"  pinned: relays on CPUs {sorted(relaying)}, the rest on {sorted(load)}", file=sys.stderr
    )


def _pin_threads(pid: int, cpus: set[int]) -> None:
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
            os.sched_setaffinity(int(task), cpus)


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process, from /proc (clock-tick resolution)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def rss_mb(pid: int) -> float:
    """Resident memory of one process now, in MiB (from /proc/<pid>/statm)."""
    with open(f"/proc/{pid}/statm") as fh:
        return int(fh.read().split()[1]) * PAGE_MB
