"""The CPU kernels for attention of a few queries per sequence (kernels/decode_attention.cpp):
built once per machine with the host's C++ compiler, then loaded by every worker.

Why kernels of our own: a decode has a few queries per KV head over one row of past K/V, and
ATen's CPU SDPA spends most of such a call setting up tiles, so the engine split the rows into
runs of near length, one masked SDPA call each (decode_rows.row_runs). `decode_attention` reads
each row exactly to its own length, in one call a layer with no mask: 1.7-2.2x the SDPA runs'
speed in bfloat16 and 1.4-1.6x in float32 over 30 layers of cold rows at 32-64 rows on a 2-core
AMX host (`bench/decode_attention.py`). `span_attention` does the same for short chunks (a
draft's verification, a prompt tail) straight from the paged cache through each sequence's
block table: 2-4x the padded, masked SDPA group at 4-8 queries (`bench/span_attention.py`).
Their float32 sums run in another order than SDPA's, so results agree to rounding, not bit for
bit.

Built with g++ straight against torch's headers and libraries (no ninja, no pybind11): `make
install` builds it (`python -m workers.decode_kernel`), and a worker that finds it missing
builds it on start (~10-15 s). The build lands in a cache directory keyed by the source, torch's
version and the CPU's vector capability, written under a temporary name and renamed, so
concurrent workers never load a half-written library. Where it cannot be built (no compiler,
another architecture) or a model's shape has no compiled variant, the engine keeps SDPA and
says so in its log (model_runner.py).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import structlog
import torch

log = structlog.get_logger("sluice.worker.kernel")

SOURCE = Path(__file__).parent / "kernels" / "decode_attention.cpp"
# What ATen's own kernels are built with for each capability (the vector types' width follows).
# NOTE: torch's headers convert half floats with F16C intrinsics; -mavx512f implies -mf16c, but
# -mavx2 does not, and without it an AVX2 host (no AVX-512) fails to compile the headers.
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}
_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet in this process


def cache_dir() -> Path:
    env = os.environ.get("SLUICE_KERNEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sluicegate" / "kernels"


def _capability() -> str:
    capability = torch.backends.cpu.get_cpu_capability()
    return capability if capability in _CAPABILITY_FLAGS else "DEFAULT"


def library_path() -> Path:
    """Where this source, torch and CPU capability's build lives."""
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update(f"{torch.__version__}|{_capability()}|{sys.platform}".encode())
    key.update(" ".join(_openmp_flags()).encode())
    return cache_dir() / f"decode_attention-{key.hexdigest()[:16]}.so"


def _openmp_flags() -> list[str]:
    """`-fopenmp` where torch runs its intra-op threads on OpenMP: ATen's `parallel_for` is a
    header there (`#pragma omp parallel`), and compiled without the flag the kernel runs on one
    thread whatever `torch.get_num_threads()` says. The library then needs `libgomp.so.1`, the
    soname torch's own libgomp has, so the process keeps one OpenMP runtime and one pool."""
    return ["-fopenmp"] if torch.backends.openmp.is_available() else []


def _compile_command(output: Path) -> list[str]:
    from torch.utils import cpp_extension

    capability = _capability()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    lib = Path(torch.__file__).parent / "lib"
    compiler = os.environ.get("CXX", "g++")
    return [
        compiler,
        "-O3",
        "-std=c++17",
        "-shared",
        "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-DCPU_CAPABILITY={capability}",
        f"-DCPU_CAPABILITY_{capability}",
        *_CAPABILITY_FLAGS.get(capability, []),
        *_openmp_flags(),
        *includes,
        str(SOURCE),
        "-o",
        str(output),
        f"-L{lib}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{lib}",
    ]


def build(target: Path | None = None) -> Path:
    """Compile the kernel to `target` (default: `library_path()`) unless this machine already
    has it; returns the library's path."""
    target = target or library_path()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(handle)
    try:
        command = _compile_command(Path(temporary))
        subprocess.run(command, check=True, capture_output=True, text=True)
        # atomic: a reader sees no library or a whole one. Other sources' builds stay (another
        # checkout, a --compare tree, may share the cache; each is ~200 KB)
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return target


def available() -> bool:
    """Whether `torch.ops.sluice.decode_attention` can be called in this process (built and
    loaded on first call; False, logged once, where it cannot be built)."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def _load() -> bool:
    if hasattr(torch.ops.sluice, "decode_attention"):
        return True
    try:
        path = library_path()
        fresh = not path.exists()
        torch.ops.load_library(str(build(path)))
    except (OSError, subprocess.CalledProcessError, RuntimeError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        log.warning("decode attention kernel unavailable; using SDPA", reason=detail[-500:])
        return False
    if fresh:
        log.info("decode attention kernel built", path=str(path))
    return True


def supports(group: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel has a variant for `group` query heads per KV head of `head_dim`."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16) or not available():
        return False
    return bool(torch.ops.sluice.decode_attention_supports(group, head_dim))


def decode_attention(
    q: torch.Tensor,
    rows: tuple[torch.Tensor, torch.Tensor],
    new: tuple[torch.Tensor, torch.Tensor],
    row_of: torch.Tensor,
    lengths: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """[N, KV, G, D] queries over rows (keys, values: [R, KV, C, D]): query n's new K/V
    (`new`: [N, KV, D] each) is written at position `lengths[n] - 1` of row `row_of[n]` and at
    slot `slots[n]` of the paged cache (`cache`: [KV, S, D] each); then the row is read to that
    length → [N, KV, G, D] in q's dtype. One dtype throughout; a row for one query at most."""
    (keys, values), (new_keys, new_values), (cache_keys, cache_values) = rows, new, cache
    return torch.ops.sluice.decode_attention(
        q,
        keys,
        values,
        new_keys,
        new_values,
        row_of,
        lengths,
        cache_keys,
        cache_values,
        slots,
        scale,
    )


def span_attention(
    q: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor],
    tables: torch.Tensor,
    spans: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """[N, KV, G, D] queries, each over the first `lengths[n]` positions of its sequence in the
    paged cache (`cache`: [KV, S, D] keys, values), found through block table `tables[spans[n]]`
    ([spans, width] block ids) → [N, KV, G, D] in q's dtype. The queries' own K/V are in the
    cache already; a chunk is causal by its queries' lengths."""
    keys, values = cache
    return torch.ops.sluice.span_attention(
        q, keys, values, tables, spans, lengths, block_size, scale
    )


if __name__ == "__main__":  # `make install`: build it now so no worker waits on the compiler
    print(f"decode attention kernel: {build()}")
