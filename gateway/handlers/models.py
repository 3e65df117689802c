"""`GET /v1/models` and `GET /v1/models/{model}`: each model with the routes that serve it
(`endpoints`, gateway/model_endpoints.py)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from adapters.base import Adapter, ModelInfo
from gateway.app_keys import CATALOG
from gateway.http.errors import model_not_found
from gateway.model_endpoints import endpoints_of


def _model_object(adapter: Adapter, info: ModelInfo) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": info.id,
        "object": "model",
        "created": info.created,
        "owned_by": info.owned_by,
    }
    if info.max_model_len:
        body["max_model_len"] = info.max_model_len
    body["endpoints"] = endpoints_of(adapter)
    return body


async def list_models(request: web.Request) -> web.Response:
    data = [_model_object(adapter, info) for adapter, info in request.app[CATALOG].served()]
    return web.json_response({"object": "list", "data": data})


async def retrieve_model(request: web.Request) -> web.Response:
    model = request.match_info["model"]
    for adapter, info in request.app[CATALOG].served():
        if info.id == model:
            return web.json_response(_model_object(adapter, info))
    raise model_not_found(model)
