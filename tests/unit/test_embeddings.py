"""The Embeddings request and answer: parsing as OpenAI checks it, base64 as OpenAI encodes it,
the worker body both ends share, and the usage record of a call its client left."""

from __future__ import annotations

import asyncio
import base64
import struct

import orjson
import pytest

from gateway.app_keys import AUTH as AUTH_KEY
from gateway.app_keys import LEDGER
from gateway.embeddings.render import embeddings_object
from gateway.embeddings.request import parse_embeddings_request
from gateway.http.errors import APIError
from testkit.scripted_adapter import ScriptedAdapter
from tests.support.gateway import AUTH, gateway_app
from tests.support.waiting import until
from wire.api import BadRequest
from wire.embed_body import MAX_EMBED_INPUTS, Embeddings, EmbedRequest, parse_embed
from wire.share import DEFAULT_SHARE, Share

VECTORS = [[0.6, -0.8, 0.0], [1.0, 0.0, 0.0]]


def make_body(**fields) -> dict:
    return {"model": "m", "input": "hello", **fields}


def refused_param(body) -> str | None:
    with pytest.raises(APIError) as caught:
        parse_embeddings_request(body)
    assert caught.value.status == 400
    return caught.value.param


def test_a_string_or_a_list_of_strings():
    assert parse_embeddings_request(make_body()).inputs == ["hello"]
    asked = parse_embeddings_request(
        make_body(input=["a", "b"], encoding_format="base64", dimensions=2, user="u")
    )
    assert (asked.inputs, asked.encoding_format, asked.dimensions, asked.user) == (
        ["a", "b"],
        "base64",
        2,
        "u",
    )
    assert parse_embeddings_request(make_body(encoding_format=None)).encoding_format == "float"
    assert parse_embeddings_request(make_body(dimensions=8.0)).dimensions == 8  # JSON's integer


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": None}, "input"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": [[1, 2], "a"]}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": [-1, 2]}, "input"),
        ({"input": [1.5]}, "input"),
        ({"input": [True]}, "input"),
        ({"input": ["a"] * (MAX_EMBED_INPUTS + 1)}, "input"),
        ({"input": {"text": "a"}}, "input"),
        ({"model": ""}, "model"),
        ({"encoding_format": "binary"}, "encoding_format"),
        ({"dimensions": 0}, "dimensions"),
        ({"dimensions": True}, "dimensions"),
        ({"dimensions": 1.5}, "dimensions"),
        ({"dimensions": 1 << 17}, "dimensions"),
        ({"user": 3}, "user"),
    ],
)
def test_refusals_name_the_field(fields, param):
    assert refused_param(make_body(**fields)) == param


def test_token_ids_are_inputs_of_their_own():
    assert parse_embeddings_request(make_body(input=[1, 2, 3.0])).inputs == [[1, 2, 3]]
    assert parse_embeddings_request(make_body(input=[[1], [2, 3]])).inputs == [[1], [2, 3]]


def test_float_answer_in_openais_shape():
    body = embeddings_object(Embeddings(VECTORS, 7), "m", "float")
    assert body == {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": VECTORS[0]},
            {"object": "embedding", "index": 1, "embedding": VECTORS[1]},
        ],
        "model": "m",
        "usage": {"prompt_tokens": 7, "total_tokens": 7},
    }


def test_base64_is_the_little_endian_float32_bytes_of_the_floats():
    body = embeddings_object(Embeddings(VECTORS, 7), "m", "base64")
    for item, vector in zip(body["data"], VECTORS, strict=True):
        raw = base64.b64decode(item["embedding"])
        assert raw == struct.pack("<3f", *vector)
        decoded = struct.unpack("<3f", raw)
        assert decoded == pytest.approx(vector, abs=1e-7)


def test_the_worker_body_round_trips_and_refuses_naming_the_field():
    sent = EmbedRequest("emb-1", ["a", "b"], 4)
    assert parse_embed(orjson.loads(sent.to_json())) == sent
    for body, param in [
        ({"request_id": "", "input": ["a"]}, "request_id"),
        ({"request_id": "r", "input": "a"}, "input"),
        ({"request_id": "r", "input": []}, "input"),
        ({"request_id": "r", "input": ["a"], "dimensions": -1}, "dimensions"),
    ]:
        with pytest.raises(BadRequest) as caught:
            parse_embed(body)
        assert caught.value.param == param


def test_the_worker_body_carries_the_callers_share_and_reads_it_back():
    share = Share("t-digest", 3.0, "flex")
    body = orjson.loads(EmbedRequest("r", ["a"], None, share).to_json())
    assert body["share"] == {"tenant": "t-digest", "weight": 3.0, "tier": "flex"}
    assert parse_embed(body).share == share
    plain = orjson.loads(EmbedRequest("r", ["a"]).to_json())
    assert "share" not in plain and parse_embed(plain).share == DEFAULT_SHARE
    with pytest.raises(BadRequest) as caught:
        parse_embed({**plain, "share": {"tenant": "t", "weight": -1, "tier": "default"}})
    assert caught.value.param.startswith("share")


async def test_the_tenants_share_reaches_the_backend(aiohttp_client, tmp_path):
    backend = HeldEmbedder("e")
    backend.release.set()
    usage = str(tmp_path / "usage.jsonl")
    client = await aiohttp_client(gateway_app([backend], usage_file=usage))
    answer = await client.post("/v1/embeddings", json={"model": "e", "input": "x"}, headers=AUTH)
    assert answer.status == 200
    (tenant,) = client.app[AUTH_KEY].config.tenants.values()
    assert backend.shares == [Share(tenant.digest, 1.0, "default")]


class HeldEmbedder(ScriptedAdapter):
    """A scripted backend whose embeddings wait until released (a call in flight)."""

    def __init__(self, model: str) -> None:
        super().__init__(model, lambda request: [])
        self.asked = asyncio.Event()
        self.release = asyncio.Event()
        self.shares: list[Share | None] = []

    async def embed(self, inputs, dimensions, request_id, share=None) -> Embeddings:
        self.shares.append(share)
        self.asked.set()
        await self.release.wait()
        return Embeddings([[1.0] for _ in inputs], 3)


async def test_a_call_the_client_leaves_is_recorded_cancelled(
    aiohttp_client, store_settings, tmp_path
):
    backend = HeldEmbedder("e")
    usage = str(tmp_path / "usage.jsonl")  # its own ledger: the session's is shared
    client = await aiohttp_client(gateway_app([backend], usage_file=usage, **store_settings))
    call = asyncio.ensure_future(
        client.post("/v1/embeddings", json={"model": "e", "input": "x"}, headers=AUTH)
    )
    await asyncio.wait_for(backend.asked.wait(), 10)
    call.cancel()

    async def recorded() -> list | None:
        records = [r async for r in client.app[LEDGER].read()]
        return records or None

    (record,) = await until(recorded, "the cancelled call's usage record")
    assert (record.status, record.cancel_source, record.prompt_tokens) == (
        "cancelled",
        "disconnect",
        0,
    )
    assert record.run_id.startswith("emb-")
