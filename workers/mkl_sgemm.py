"""MKL's packed single-precision GEMM (`cblas_sgemm_pack` / `cblas_sgemm_compute`), reached in
torch's own library.

Why: on a CPU with AMX tiles float32 has no tiles (they take bfloat16 and int8), and the BLAS's
`F.linear` re-lays each weight out on every call; at decode batch sizes that is much of a GEMM's
time. MKL can lay a weight out once for its own kernels and then run every call on it, whatever
the number of rows (`cblas_sgemm_pack_get_size` answers the same for 1 and 256 rows, and every
row count comes out as `F.linear`'s within float32 rounding). torch's x86 builds link MKL in and
export its CBLAS functions, so no other library is loaded. Where torch was built without MKL, or
its packed GEMM disagrees with `F.linear` on a first check (the row counts' independence is
measured, not documented), `available()` says so and packed_linear.py keeps another layout.

Two rules of MKL's own: a packed buffer is never moved (its metadata depend on its address:
a torch tensor's storage does not move, and `PackedWeight` refuses a copy), and packing
and computing run on the same number of threads (both on torch's, which a worker leaves as
they start).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from pathlib import Path
from typing import NoReturn

import structlog
import torch
import torch.nn.functional as F

log = structlog.get_logger("sluice.worker.kernel")

_ROW_MAJOR, _NO_TRANS, _TRANS, _B_MATRIX, _PACKED = 101, 111, 112, 162, 151
_int, _ptr, _float = ctypes.c_int, ctypes.c_void_p, ctypes.c_float
# The rows MKL is told a weight will be multiplied by when it packs it; any number may be. Of 1,
# 16, 32, 64, 256 and 1,024 on a 2-core AMX host, 256 was the best from 8 rows to 512 and within
# 4% of the BLAS at one (bench/packed_gemm.py; 1,024 cost a lone sequence 40%, 16 lost at 64+).
PACKED_ROWS = 256


@functools.cache
def _cblas() -> ctypes.CDLL | None:
    """torch's library, with the three functions' signatures; None where it has no MKL."""
    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        get_size, pack, compute = (
            lib.cblas_sgemm_pack_get_size,
            lib.cblas_sgemm_pack,
            lib.cblas_sgemm_compute,
        )
    except (OSError, AttributeError):  # another platform's library, or MKL's symbols hidden
        return None
    get_size.restype = ctypes.c_size_t
    get_size.argtypes = [_int, _int, _int, _int]
    pack.restype = None
    pack.argtypes = [_int, _int, _int, _int, _int, _int, _float, _ptr, _int, _ptr]
    compute.restype = None
    compute.argtypes = [
        *(_int, _int, _int, _int, _int, _int),  # layout, op(A), op(B), m, n, k
        *(_ptr, _int, _ptr, _int, _float, _ptr, _int),  # a, lda, b, ldb, beta, c, ldc
    ]
    return lib


def carried() -> bool:
    """Whether this torch carries MKL's packed GEMM at all."""
    return _cblas() is not None


# (out, in) shapes like a model's layers (both of the default model's widths, and odd ones): MKL
# takes other blocking paths for other shapes, so the check below covers more than one
_CHECKED_SHAPES = ((1536, 576), (576, 1536), (1000, 777))


@functools.cache
def available() -> bool:
    """Whether MKL's packed GEMM is carried and computes what `F.linear` does at row counts other
    than the one it packed for (checked once, about 40 ms at a start: the independence is measured,
    not documented, and another MKL that broke it would be wrong silently)."""
    if not carried():
        return False
    generator = torch.Generator().manual_seed(0)
    for shape in _CHECKED_SHAPES:
        weight = torch.randn(shape, generator=generator)
        packed = pack(weight)
        for rows in (1, 17, PACKED_ROWS + 1):
            x = torch.randn(rows, shape[1], generator=generator)
            if not torch.allclose(packed(x), F.linear(x, weight), rtol=1e-4, atol=1e-3):
                log.warning("MKL's packed GEMM disagrees with F.linear; not used", rows=rows)
                return False
    return True


class PackedWeight:
    """A weight ([out, in]) laid out by MKL; called on rows ([m, in], float32, contiguous, CPU),
    it returns rows @ weightᵀ ([m, out]). It cannot be copied or pickled: MKL's layout depends
    on the buffer's address (a copy elsewhere computed wrong numbers, then crashed)."""

    __slots__ = ("_buffer", "in_features", "out_features")

    def __init__(self, buffer: torch.Tensor, out_features: int, in_features: int) -> None:
        self._buffer, self.out_features, self.in_features = buffer, out_features, in_features

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        if (
            rows.dtype is not torch.float32
            or rows.device.type != "cpu"
            or rows.dim() != 2
            or rows.shape[1] != self.in_features
            or not rows.is_contiguous()
        ):
            # NOTE: MKL reads and writes float32 by the shapes it is given, whatever the tensor
            raise ValueError(f"expected contiguous float32 CPU rows of {self.in_features}")
        m = rows.shape[0]
        out = torch.empty(m, self.out_features, dtype=torch.float32)
        if m:
            _cblas().cblas_sgemm_compute(
                _ROW_MAJOR,
                _NO_TRANS,
                _PACKED,
                m,
                self.out_features,
                self.in_features,
                rows.data_ptr(),
                self.in_features,
                self._buffer.data_ptr(),
                self.in_features,
                0.0,
                out.data_ptr(),
                self.out_features,
            )
        return out

    def __reduce_ex__(self, protocol: object) -> NoReturn:
        raise TypeError("an MKL-packed weight cannot be copied: its layout depends on its address")


def pack(weight: torch.Tensor) -> PackedWeight:
    """`weight` ([out, in], float32, CPU) laid out once by MKL.

    NOTE: MKL asks for a buffer sized for its worst case (2-9x the weight at the default model's
    shapes) and writes about the weight's own size of it. The buffer is a private mapping of its
    own, not the heap's: pages never written stay out of RSS only where nothing was there before
    (taken from the heap, freed chunks already resident made a worker 270 MiB larger)."""
    lib = _cblas()
    if lib is None:
        raise RuntimeError("this torch has no MKL")
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError("MKL's packed GEMM takes a 2-D float32 CPU weight")
    weight = weight.contiguous()
    out_features, in_features = weight.shape
    size = lib.cblas_sgemm_pack_get_size(_B_MATRIX, PACKED_ROWS, out_features, in_features)
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)  # anonymous, page-aligned, zero
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    lib.cblas_sgemm_pack(
        _ROW_MAJOR,
        _B_MATRIX,
        _TRANS,  # B = weightᵀ: the layer computes x @ weightᵀ
        PACKED_ROWS,
        out_features,
        in_features,
        1.0,
        weight.data_ptr(),
        in_features,
        buffer.data_ptr(),
    )
    return PackedWeight(buffer, out_features, in_features)
