"""The Embeddings request (`POST /v1/embeddings`), checked as OpenAI's: `model`, `input` (a
string, a list of strings, an array of token ids or a list of such arrays), `encoding_format`
(`float` or `base64`), `dimensions`, `user`. Unknown fields are ignored, as elsewhere in the
gateway."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.http.errors import invalid_request
from gateway.protocol import _integer
from gateway.token_ids import texts_or_ids
from wire.embed_body import MAX_DIMENSIONS, MAX_EMBED_INPUTS, EmbedInput

ENCODINGS = ("float", "base64")


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    model: str
    inputs: list[EmbedInput]
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


def parse_embeddings_request(body: Any) -> EmbeddingsRequest:
    """The request, or an APIError (400) naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise invalid_request(None, "The body must be a JSON object.", code="invalid_type")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_request(
            "model", "Missing required parameter: 'model'.", code="missing_required_parameter"
        )
    inputs = texts_or_ids(body.get("input"), "input", MAX_EMBED_INPUTS)
    encoding = body.get("encoding_format")
    encoding = "float" if encoding is None else encoding
    if encoding not in ENCODINGS:
        raise invalid_request(
            "encoding_format", "Invalid 'encoding_format': expected 'float' or 'base64'."
        )
    dimensions = _integer(body, "dimensions", 1, MAX_DIMENSIONS)  # JSON's 8.0 is an integer too
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid_request("user", "Invalid type for 'user': expected a string.", "invalid_type")
    return EmbeddingsRequest(model, inputs, encoding, dimensions, user)
