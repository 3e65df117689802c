"""Freed heap memory goes back to the OS: the weights fusing and packing replace at start would
otherwise stay resident for the worker's life."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# NOTE: run in a fresh interpreter, as a worker starts. glibc tunes its thresholds on what a
# process freed before (freeing a large mmapped block raises the mmap and trim thresholds), so
# after other tests `free` itself may already have trimmed the heap, and the measurement would
# say more about those tests than about `trim_heap`.
_CHILD = """
import json, psutil, torch
from workers.heap import trim_heap

def rss_mib():
    return psutil.Process().memory_info().rss / 2**20

# 100 kB tensors: under malloc's mmap threshold, so freeing them leaves the pages resident
held = [torch.ones(25_000) for _ in range(2_000)]
del held
before = rss_mib()
trimmed = trim_heap()
print(json.dumps({"trimmed": trimmed, "before": before, "after": rss_mib()}))
"""


@pytest.mark.process
def test_trimming_returns_freed_tensors_pages() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True, timeout=120
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["trimmed"] is True
    assert seen["after"] < seen["before"] - 100, "about 200 MiB freed; most of it must leave"
