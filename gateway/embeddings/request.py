"""The Embeddings request (`POST /v1/embeddings`), checked as OpenAI's: `model`, `input` (a
string or a list of strings; token ids are refused for now), `encoding_format` (`float` or
`base64`), `dimensions`, `user`. Unknown fields are ignored, as elsewhere in the gateway."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.http.errors import invalid_request
from gateway.protocol import _integer
from wire.embed_body import MAX_DIMENSIONS, MAX_EMBED_INPUTS

ENCODINGS = ("float", "base64")


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    model: str
    inputs: list[str]
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _inputs(value: Any) -> list[str]:
    if value is None:
        raise invalid_request(
            "input", "Missing required parameter: 'input'.", code="missing_required_parameter"
        )
    texts = [value] if isinstance(value, str) else value
    if isinstance(texts, list) and texts and all(isinstance(t, str) for t in texts):
        if not all(texts):
            raise invalid_request("input", "Invalid 'input': a string must not be empty.")
        if len(texts) > MAX_EMBED_INPUTS:
            raise invalid_request(
                "input", f"Invalid 'input': at most {MAX_EMBED_INPUTS} strings per request."
            )
        return texts
    if isinstance(texts, list) and texts and all(_is_int(t) or isinstance(t, list) for t in texts):
        raise invalid_request(
            "input",
            "Invalid 'input': token ids are not supported yet; send the text as strings.",
            code="unsupported_value",
        )
    raise invalid_request(
        "input",
        "Invalid type for 'input': expected a string or a non-empty array of strings.",
        code="invalid_type",
    )


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
