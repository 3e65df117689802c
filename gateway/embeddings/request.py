"""The Embeddings request (`POST /v1/embeddings`), checked as OpenAI's: `model`, `input` (a
string, a list of strings, an array of token ids or a list of such arrays), `encoding_format`
(`float` or `base64`), `dimensions`, `user`. Unknown fields are ignored, as elsewhere in the
gateway."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.http.errors import invalid_request
from gateway.protocol import _integer
from gateway.token_ids import MAX_TOKEN_ID, all_alike, as_ids, is_token_ids
from wire.embed_body import MAX_DIMENSIONS, MAX_EMBED_INPUTS, EmbedInput

ENCODINGS = ("float", "base64")


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    model: str
    inputs: list[EmbedInput]
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


def _inputs(value: Any) -> list[EmbedInput]:
    if value is None:
        raise invalid_request(
            "input", "Missing required parameter: 'input'.", code="missing_required_parameter"
        )
    if isinstance(value, str):
        inputs: list[EmbedInput] = [value]
    elif is_token_ids(value):
        inputs = [as_ids(value)]
    elif isinstance(value, list) and value and all_alike(value):
        inputs = [v if isinstance(v, str) else as_ids(v) for v in value]
    else:
        raise invalid_request(
            "input",
            "Invalid type for 'input': expected a string, an array of strings, an array of "
            f"token ids (integers from 0 to {MAX_TOKEN_ID}) or an array of such arrays, none "
            "of them empty.",
            code="invalid_type",
        )
    if any(v == "" for v in inputs):
        raise invalid_request("input", "Invalid 'input': a string must not be empty.")
    if len(inputs) > MAX_EMBED_INPUTS:
        raise invalid_request(
            "input", f"Invalid 'input': at most {MAX_EMBED_INPUTS} inputs per request."
        )
    return inputs


def parse_embeddings_request(body: Any) -> EmbeddingsRequest:
    """The request, or an APIError (400) naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise invalid_request(None, "The body must be a JSON object.", code="invalid_type")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_request(
            "model", "Missing required parameter: 'model'.", code="missing_required_parameter"
        )
    inputs = _inputs(body.get("input"))
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
