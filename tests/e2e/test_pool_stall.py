"""A member whose engine hangs while its HTTP server goes on answering (tests/support/
hanging_worker.py), in a pool of two `--worker-url` workers under a real `sluice serve`: its
step counter stands still with work, so it is ejected as stalled within `--stall-timeout`, and
its runs continue on the other member as if nothing had happened."""

from __future__ import annotations

import signal
from collections.abc import Callable

import psutil
import pytest

from tests.e2e.test_pool_migration import assert_as_if_uninterrupted, cut_mid_stream, running
from tests.e2e.test_worker_faults import metric
from tests.support.serve import serving
from tests.support.waiting import until_sync
from tests.support.worker_process import running_worker

# alone (tests/support/tiers.py): it times how soon a hung engine is ejected
pytestmark = pytest.mark.alone


def test_a_hung_engine_is_ejected_as_stalled_and_its_runs_move(tiny_model_dir, tmp_path):
    with (
        running_worker(tiny_model_dir, tmp_path) as steady,
        running_worker(tiny_model_dir, tmp_path, module="tests.support.hanging_worker") as hung,
    ):
        flags = ("--worker-url", steady.url, "--worker-url", hung.url, "--stall-timeout", "2")
        with serving(None, *flags) as gateway:  # the two workers only
            member = f"worker:{hung.url}"

            def hang() -> Callable[[], None]:
                until_sync(lambda: running(psutil.Process(hung.proc.pid)) > 0, "work on it")
                hung.proc.send_signal(signal.SIGUSR1)
                return lambda: None

            streams, reference = cut_mid_stream(gateway, hang, "stall")
            assert metric(gateway, "sluice_pool_member_stalls_total", member=member) == 1
            stall = {"member": member, "reason": "stall"}
            assert metric(gateway, "sluice_member_ejections_total", **stall) == 1
            assert metric(gateway, "sluice_pool_member_healthy", member=member) == 0
            assert metric(gateway, "sluice_run_migrations_total", outcome="continued") >= 1
            assert_as_if_uninterrupted(streams, reference)
