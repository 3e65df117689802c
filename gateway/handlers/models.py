"""`GET /v1/models` and `GET /v1/models/{model}`."""

from __future__ import annotations

from aiohttp import web

from adapters.base import ModelInfo
from gateway.app_keys import CATALOG
from gateway.http.errors import model_not_found


def _model_object(info: ModelInfo) -> dict:
    body = {"id": info.id, "object": "model", "created": info.created, "owned_by": info.owned_by}
    if info.max_model_len:
        body["max_model_len"] = info.max_model_len
    return body


async def list_models(request: web.Request) -> web.Response:
    data = [_model_object(info) for info in request.app[CATALOG].models()]
    return web.json_response({"object": "list", "data": data})


async def retrieve_model(request: web.Request) -> web.Response:
    model = request.match_info["model"]
    for info in request.app[CATALOG].models():
        if info.id == model:
            return web.json_response(_model_object(info))
    raise model_not_found(model)
