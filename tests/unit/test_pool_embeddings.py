"""A pool's embeddings (`PoolAdapter.embed`): sent to a member that serves them, and to the next
one when a member fails before its answer, as a run not yet started would be; a refusal is the
request's own; a pool with no member serving them refuses naming `model`."""

from __future__ import annotations

import pytest

from adapters.base import BackendRejected, BackendUnavailable
from adapters.pool import PoolAdapter
from wire.embed_body import Embeddings


class Member:
    """A member that serves no embeddings: no `embed` at all."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[list[str]] = []

    async def ready(self) -> bool:
        return True

    def unsupported_param(self, request) -> str | None:
        return None


class EmbeddingMember(Member):
    def __init__(self, name: str, fail: Exception | None = None) -> None:
        super().__init__(name)
        self.fail = fail

    async def embed(self, inputs, dimensions, request_id, share=None):
        self.calls.append(inputs)
        if self.fail is not None:
            raise self.fail
        return Embeddings([[1.0, 0.0]] * len(inputs), len(inputs))


async def test_a_failure_before_the_answer_goes_to_the_next_member():
    down = EmbeddingMember("a", BackendUnavailable("down"))
    up = EmbeddingMember("b")
    pool = PoolAdapter([down, up], model="m", routing="least_load")
    answer = await pool.embed(["x", "y"], None, "emb-1")
    assert answer == Embeddings([[1.0, 0.0], [1.0, 0.0]], 2)
    assert (down.calls, up.calls) == ([["x", "y"]], [["x", "y"]])
    assert [m.failures_total for m in pool.members] == [1, 0]
    assert all(m.in_flight == 0 for m in pool.members)


async def test_members_without_embeddings_are_skipped():
    plain, serving = Member("a"), EmbeddingMember("b")
    pool = PoolAdapter([plain, serving], model="m", routing="least_load")
    for _ in range(3):
        await pool.embed(["x"], None, "emb-1")
    assert len(serving.calls) == 3


async def test_a_refusal_is_not_retried():
    refusing = EmbeddingMember("a", BackendRejected("too many", "dimensions"))
    other = EmbeddingMember("b")
    pool = PoolAdapter([refusing, other], model="m", routing="random")
    pool.members[1].healthy = False  # only the refusing one is usable
    with pytest.raises(BackendRejected) as caught:
        await pool.embed(["x"], 9, "emb-1")
    assert caught.value.param == "dimensions" and other.calls == []


async def test_no_member_serving_embeddings_is_a_refusal_naming_model():
    pool = PoolAdapter([Member("a")], model="m")
    with pytest.raises(BackendRejected) as caught:
        await pool.embed(["x"], None, "emb-1")
    assert caught.value.param == "model"


async def test_every_member_failing_is_the_last_failure():
    pool = PoolAdapter(
        [
            EmbeddingMember("a", BackendUnavailable("down")),
            EmbeddingMember("b", BackendUnavailable("down")),
        ],
        model="m",
    )
    with pytest.raises(BackendUnavailable):
        await pool.embed(["x"], None, "emb-1")
