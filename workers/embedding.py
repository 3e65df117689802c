"""Embeddings from a decoder-only model: the final hidden state, mean-pooled, L2-normalised.

Why mean pooling: a decoder LM has no CLS token whose state summarises the text, and its last
token's state is trained to predict the next token rather than to stand for the whole; the mean
over every token's final state (after the last norm, without the LM head) is the common choice
for such models, and what the gateway documents. A model folder may declare its own, as a
sentence-transformers folder does (`modules.json` naming a Pooling module whose `config.json`
sets `pooling_mode_mean_tokens`, `pooling_mode_cls_token` or `pooling_mode_lasttoken`): then
that one (`declared_pooling`). The vector is always L2-normalised, as OpenAI's are.

An input runs through the engine's own steps as a prompt that never samples (Engine.add_embedding):
its chunks share each step's forward pass with the decodes, under the same token budget and step
time target as any prefill, so a batch of long documents cannot stretch the running streams'
inter-token gaps past the step budget. Its KV blocks hold its own earlier chunks for the later
ones and go back when it ends; it neither takes nor leaves prefix-cache blocks (its vector needs
every token's state, and an embedded text must not become findable by another tenant's timing).
Each chunk's rows are summed on the device as they come; the mean, the optional truncation
(`dimensions`, Matryoshka: the leading components) and the norm are taken once, at the end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from wire.share import DEFAULT_SHARE, Share


def hidden_size(model: Any) -> int:
    return int(model.config.hidden_size)


@dataclass(frozen=True, slots=True)
class EmbeddingJob:
    """One input to embed: its token ids, the leading components kept (None: all), and its
    caller's share of a saturated engine."""

    request_id: str
    prompt_ids: list[int]
    dimensions: int | None = None
    share: Share = DEFAULT_SHARE  # its tenant, weight and tier (fair_policy.py)


@dataclass(frozen=True, slots=True)
class PooledLine:
    """An embedding's result, among its request's lines (never sent on the wire as such)."""

    vector: list[float]
    type: str = "pooled"

    def wire(self) -> dict[str, Any]:
        return {"type": self.type, "dimensions": len(self.vector)}


POOLINGS = ("mean", "cls", "last")  # sentence-transformers' mean_tokens, cls_token, lasttoken
_ST_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_MODES["pooling_mode_lasttoken"] = "last"


def declared_pooling(model: Any) -> str:
    """The pooling the model's folder declares (sentence-transformers' files), else `mean`.
    A folder declaring a mode sluicegate does not compute (max, weighted mean) is refused at
    start rather than answered differently."""
    folder = Path(getattr(model.config, "_name_or_path", "") or ".")
    modules = folder / "modules.json"
    if not modules.is_file():
        return "mean"
    for module in json.loads(modules.read_text()):
        if module.get("type", "").endswith("Pooling"):
            config = json.loads((folder / module.get("path", "") / "config.json").read_text())
            chosen = [mode for key, mode in _ST_MODES.items() if config.get(key)]
            others = [k for k, on in config.items() if k.startswith("pooling_mode") and on]
            if len(chosen) != 1 or len(others) != 1:
                raise ValueError(f"{modules}: pooling {others} is not one of {POOLINGS}")
            return chosen[0]
    return "mean"


class Pool:
    """One input's pooled final hidden state as its chunks come, in float32 on the model's
    device: the running sum (`mean`), the first position's row (`cls`) or the latest (`last`)."""

    __slots__ = ("dimensions", "mode", "total")

    def __init__(self, mode: str, dimensions: int | None) -> None:
        assert mode in POOLINGS, mode
        self.mode, self.dimensions = mode, dimensions
        self.total: torch.Tensor | None = None

    def add(self, rows: torch.Tensor, first_position: int) -> None:
        """Add a chunk's rows [new, hidden]; a chunk from position 0 starts over (the sequence
        was preempted and is being computed again)."""
        if self.mode == "last":
            self.total = rows[-1].float()
        elif first_position == 0:
            self.total = rows[0].float() if self.mode == "cls" else rows.float().sum(dim=0)
        elif self.mode == "mean":
            assert self.total is not None, "a chunk after position 0 came first"
            self.total += rows.float().sum(dim=0)

    def vector(self, count: int) -> list[float]:
        """The unit vector of the pooled state over `count` positions. Reads the device once."""
        assert self.total is not None, "no chunk was pooled"
        pooled = self.total / count if self.mode == "mean" else self.total
        if self.dimensions is not None:
            pooled = pooled[: self.dimensions]
        return torch.nn.functional.normalize(pooled, dim=0).tolist()
