"""The Embeddings API's part of the OpenAPI document (gateway/openapi/document.py): its route
and schemas, as gateway/embeddings/request.py checks a request and gateway/handlers/embeddings.py
answers."""

from __future__ import annotations

from typing import Any

from gateway.openapi.document import JSON, _answer, _errors
from gateway.openapi.schemas import _nullable, _object, ref
from gateway.token_ids import MAX_TOKEN_ID
from wire.embed_body import MAX_DIMENSIONS, MAX_EMBED_INPUTS


def _request() -> dict[str, Any]:
    text = {"type": "string", "minLength": 1}
    ids = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID},
    }
    many = {"type": "array", "minItems": 1, "maxItems": MAX_EMBED_INPUTS}
    return {
        "type": "object",
        "required": ["model", "input"],
        "description": "OpenAI's Embeddings request; unknown fields are ignored. Token ids at "
        "or above the model's vocabulary are a 400 naming `input`; `dimensions` above the "
        "model's size is a 400 naming it.",
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "input": {"anyOf": [text, {**many, "items": text}, ids, {**many, "items": ids}]},
            "encoding_format": {
                "enum": ["float", "base64", None],
                "description": "`base64`: each vector's little-endian float32 bytes, base64'd.",
            },
            "dimensions": {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_DIMENSIONS},
            "user": _nullable("string"),
        },
    }


def _answer_schema() -> dict[str, Any]:
    item = _object(
        ["object", "index", "embedding"],
        object={"const": "embedding"},
        index={"type": "integer", "minimum": 0},
        embedding={"anyOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]},
    )
    usage = _object(
        ["prompt_tokens", "total_tokens"],
        prompt_tokens={"type": "integer"},
        total_tokens={"type": "integer"},
    )
    return _object(
        ["object", "data", "model", "usage"],
        object={"const": "list"},
        data={"type": "array", "items": item},
        model={"type": "string"},
        usage=usage,
    )


def with_embeddings(document: dict[str, Any]) -> dict[str, Any]:
    """The document with the Embeddings route and schemas added."""
    create = {
        "operationId": "createEmbeddings",
        "summary": "Unit vectors of the inputs: the model's final hidden state, mean-pooled "
        "(own workers), or an OpenAI-compatible upstream's own embeddings; a model alias's "
        "targets are asked in turn (`x-sluice-route` says which served, `model` names it).",
        "requestBody": {
            "required": True,
            "content": {JSON: {"schema": ref("EmbeddingsRequest")}},
        },
        "responses": {
            "200": _answer("The embeddings.", {JSON: {"schema": ref("Embeddings")}}),
            **_errors(400, 401, 403, 404, 408, 413, 415, 429, 502, 503),
        },
    }
    document["paths"]["/v1/embeddings"] = {"post": create}
    document["components"]["schemas"].update(
        {"EmbeddingsRequest": _request(), "Embeddings": _answer_schema()}
    )
    return document
