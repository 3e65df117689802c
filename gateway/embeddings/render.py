"""The Embeddings answer in OpenAI's shape: a `list` of `embedding` objects, each vector as
numbers or (`encoding_format: base64`) as its little-endian float32 bytes in base64, as
OpenAI sends them and its SDK decodes them."""

from __future__ import annotations

import base64
import struct
from typing import Any

from wire.embed_body import Embeddings


def encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def embeddings_object(answer: Embeddings, model: str, encoding_format: str) -> dict[str, Any]:
    data = [
        {"object": "embedding", "index": i, "embedding": encoded(vector, encoding_format)}
        for i, vector in enumerate(answer.vectors)
    ]
    tokens = answer.prompt_tokens
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
