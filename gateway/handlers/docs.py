"""`GET /openapi.json`: the public API's OpenAPI document, built once per process."""

from __future__ import annotations

import functools
from importlib import metadata

import orjson
from aiohttp import web

from gateway.openapi.admin import with_admin
from gateway.openapi.anthropic import with_anthropic
from gateway.openapi.completions import with_completions
from gateway.openapi.document import openapi_document
from gateway.openapi.embeddings import with_embeddings
from gateway.openapi.responses import with_responses


@functools.cache
def _document() -> bytes:
    try:
        version = metadata.version("sluicegate")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        version = "0+unknown"
    document = with_completions(with_responses(openapi_document(version)))
    return orjson.dumps(with_admin(with_embeddings(with_anthropic(document))))


async def openapi_json(request: web.Request) -> web.Response:
    return web.Response(body=_document(), content_type="application/json")
