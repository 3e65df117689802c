"""Gives a CPU model's weights memory of their own, so the checkpoint's mapped file can go.

Why: transformers maps a safetensors checkpoint into memory and, where the dtype matches, hands
out tensors that are views of that mapping. Fusing and packing then replace most weights with
new copies, but the embedding (and any weight left as loaded) still views the mapping, so the
whole file stays mapped, and every page read while fusing and packing stays resident: clean,
reclaimable page cache, but counted in the worker's RSS (and in its cgroup). Measured on the
default model in float32, fused and packed: 1,400 MiB resident (612 of it file pages) without
the copy, 995 MiB with it; made first, before fusing, it also lowers the peak (1,398 against
1,508 MiB made last).
"""

from __future__ import annotations

import torch
from torch import nn


def own_weights(model: nn.Module) -> None:
    """Copy every parameter and buffer of `model` into memory of its own (one at a time, so the
    peak grows by the largest of them); a tensor shared by two modules stays shared."""
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.device.type == "cpu" and tensor.layout == torch.strided:
                tensor.data = tensor.data.clone()
