"""The `/v1/embed` body and answer of the worker API (docs/worker-api.md), both ends: the
gateway's worker adapter builds the body (`EmbedRequest`) and reads the answer
(`read_embed_answer`); the worker parses the body (`parse_embed`). Torch-free, like wire/api.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from wire.api import BadRequest
from wire.generate_body import parse_request_id, parse_share
from wire.share import DEFAULT_SHARE, Share

MAX_EMBED_INPUTS = 256  # inputs in one call (the gateway refuses more before it asks)
MAX_DIMENSIONS = 1 << 16  # far above any model's size: only bounds the parsing
EmbedInput = str | list[int]  # a text, or its token ids (the worker checks them against its vocab)


@dataclass(frozen=True, slots=True)
class EmbedRequest:
    """A `/v1/embed` body: the inputs (texts, or token ids), in order, and the Matryoshka size
    (None: the model's)."""

    request_id: str
    inputs: list[EmbedInput]
    dimensions: int | None = None
    share: Share = DEFAULT_SHARE  # its tenant, weight and tier, as for a generation

    def to_json(self) -> bytes:
        body = {"request_id": self.request_id, "input": self.inputs, "dimensions": self.dimensions}
        if self.share != DEFAULT_SHARE:
            body["share"] = self.share.wire()
        return orjson.dumps(body)


@dataclass(frozen=True, slots=True)
class Embeddings:
    """An answer: one unit vector per input, in order, and the input tokens they took."""

    vectors: list[list[float]]
    prompt_tokens: int

    def wire(self) -> dict[str, Any]:
        return {"data": self.vectors, "prompt_tokens": self.prompt_tokens}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_int(t) and t >= 0 for t in value)


def parse_embed(body: Any) -> EmbedRequest:
    """Validate a decoded `/v1/embed` body; raises BadRequest naming the first bad field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", None, "invalid_type")
    request_id = parse_request_id(body)
    inputs = body.get("input")
    if not isinstance(inputs, list) or not (
        all(isinstance(s, str) and s for s in inputs) or all(map(_is_ids, inputs))
    ):
        raise BadRequest(
            "input must be a list of non-empty strings, or of non-empty arrays of token ids",
            "input",
            "invalid_type",
        )
    if not 0 < len(inputs) <= MAX_EMBED_INPUTS:
        raise BadRequest(f"input must hold 1 to {MAX_EMBED_INPUTS} inputs", "input")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not _is_int(dimensions) or not 0 < dimensions <= MAX_DIMENSIONS):
        raise BadRequest(
            f"dimensions must be an integer from 1 to {MAX_DIMENSIONS}",
            "dimensions",
            "invalid_type",
        )
    return EmbedRequest(request_id, inputs, dimensions, parse_share(body))


def read_embed_answer(raw: bytes) -> Embeddings:
    """The worker's answer read back; ValueError for one not in this version's shape."""
    answer = orjson.loads(raw)
    data, tokens = answer.get("data"), answer.get("prompt_tokens")
    if not isinstance(data, list) or not _is_int(tokens):
        raise ValueError("not an embeddings answer")
    return Embeddings(data, tokens)
