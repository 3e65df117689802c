"""Hands memory the process freed back to the operating system (glibc's `malloc_trim`).

Why: fusing and packing replace every projection's weight once, at start, and the old tensors go
back to glibc's malloc, which keeps the pages for reuse that never comes. Measured on the
default model in bfloat16: 691 MiB resident when loaded, 1,069 MiB after fusing and packing,
728 MiB once trimmed (most of the 37 MiB left is the output projection's packed copy).
"""

from __future__ import annotations

import ctypes
import ctypes.util


def trim_heap() -> bool:
    """Return the heap's free pages to the OS; False where the C library has no `malloc_trim`
    (not glibc) or had nothing to return."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    trim = getattr(libc, "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False
