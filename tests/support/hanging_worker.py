"""A real `sluice worker` whose engine hangs on SIGUSR1, the way a wedged GPU looks from outside:
its HTTP server goes on answering `/health` and `/v1/stats`, and its step counter stands still
while it holds work. Run as `python -m tests.support.hanging_worker` with the worker's flags."""

from __future__ import annotations

import signal
import sys
import threading

from workers import cli
from workers.engine import Engine

_hang = threading.Event()
_step = Engine.step


def _hanging_step(self: Engine) -> list:
    if _hang.is_set():
        threading.Event().wait()  # never set: this engine thread takes no further step
    return _step(self)


if __name__ == "__main__":
    Engine.step = _hanging_step
    signal.signal(signal.SIGUSR1, lambda *_: _hang.set())
    sys.exit(cli.main())
