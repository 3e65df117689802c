"""A worker's settings, validated once; the CLI and tests both build one of these.

The schema itself lives in common/worker_settings.py, torch-free, so that `sluice serve` can check
the settings it hands the workers it starts; the worker's modules import it from here.
"""

from __future__ import annotations

from common.worker_settings import (
    DEVICES,
    DTYPES,
    STEP_TIME_TARGETS,
    WorkerConfig,
    default_step_time_target,
)

__all__ = ["DEVICES", "DTYPES", "STEP_TIME_TARGETS", "WorkerConfig", "default_step_time_target"]
