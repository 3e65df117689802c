"""Freed heap memory goes back to the OS: the weights fusing and packing replace at start would
otherwise stay resident for the worker's life."""

from __future__ import annotations

import psutil
import torch

from workers.heap import trim_heap


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def test_trimming_returns_freed_tensors_pages() -> None:
    # 100 kB tensors: under malloc's mmap threshold, so freeing them leaves the pages resident
    held = [torch.ones(25_000) for _ in range(2_000)]
    del held
    before = rss_mib()
    assert trim_heap() is True
    assert rss_mib() < before - 100, "about 200 MiB freed; most of it must leave"
