"""Embeddings from a decoder-only model: the final hidden state, mean-pooled, L2-normalised.

Why mean pooling: a decoder LM has no CLS token whose state summarises the text, and its last
token's state is trained to predict the next token rather than to stand for the whole; the mean
over every token's final state (after the last norm, without the LM head) is the common choice
for such models, and what the gateway documents. A sentence-transformers folder may declare its
own pooling (`modules.json`, `1_Pooling/config.json`); this first version does not read it yet.

NOTE: each input runs as its own forward pass (no padding, so a text's vector does not depend on
what it was sent with), on the worker's embedding thread under `torch.inference_mode()`, not
through the engine's steps: it shares the device (and on CPU the cores) with decoding, and is not
yet bounded by the step budget. Batching through the engine is the next step (issue #37).
"""

from __future__ import annotations

from typing import Any

import torch


def hidden_size(model: Any) -> int:
    return int(model.config.hidden_size)


def embed_ids(model: Any, prompts: list[list[int]], dimensions: int | None) -> list[list[float]]:
    """One unit vector per prompt (token ids), truncated to `dimensions` first when given
    (Matryoshka: the leading components, renormalised)."""
    base = model.base_model  # the decoder without its LM head (`model.model` for Llama)
    device = next(model.parameters()).device
    vectors = []
    with torch.inference_mode():
        for ids in prompts:
            input_ids = torch.tensor([ids], dtype=torch.long, device=device)
            hidden = base(input_ids=input_ids, use_cache=False).last_hidden_state[0]
            pooled = hidden.float().mean(dim=0)
            if dimensions is not None:
                pooled = pooled[:dimensions]
            vectors.append(torch.nn.functional.normalize(pooled, dim=0).tolist())
    return vectors
