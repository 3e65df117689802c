"""Host numbers onto the model's device without making the host wait for it.

`torch.tensor(values, device="cuda")` copies from pageable memory, and PyTorch then synchronizes
the stream: every such call waits for all the work queued before it. A step builds a dozen of
these (positions, slots, block tables, row indexes), so a step would wait a dozen times. Here
the values are staged in pinned memory and copied with `non_blocking`: PyTorch's pinned-memory
cache keeps the staging buffer until the copy has run, so the host may go on at once. On a CPU
device it is the plain `torch.tensor`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[float],
    device: torch.device | str,
    dtype: torch.dtype = torch.long,
) -> torch.Tensor:
    """`values` as a 1-D tensor of `dtype` on `device`, queued rather than awaited on CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    staged = torch.tensor(values, dtype=dtype, pin_memory=True)
    return staged.to(device, non_blocking=True)


def copy_into(out: torch.Tensor, values: Sequence[int] | Sequence[float]) -> None:
    """`values` into the first `len(values)` elements of the 1-D `out`, queued rather than
    awaited on CUDA: a fixed buffer (a CUDA graph's input) filled from the host in one copy."""
    staged = torch.tensor(values, dtype=out.dtype, pin_memory=out.device.type == "cuda")
    out[: len(values)].copy_(staged, non_blocking=True)
