"""A pool's token counts (`PoolAdapter.count_tokens`): the member a request would be routed to
counts, the next one when it cannot, members that do not count are skipped, and a pool where
none can says so (None: the gateway estimates)."""

from __future__ import annotations

from adapters.base import TokenCount
from adapters.pool import PoolAdapter
from adapters.requests import ChatRequest, Message
from tests.unit.test_pool_embeddings import Member

ASKED = ChatRequest("m", [Message("user", "Hi")])


class CountingMember(Member):
    def __init__(self, name: str, answer: TokenCount | None) -> None:
        super().__init__(name)
        self.answer = answer
        self.asked = 0

    async def count_tokens(self, request: ChatRequest, request_id: str) -> TokenCount | None:
        self.asked += 1
        return self.answer


async def test_the_next_member_counts_when_the_first_cannot():
    silent = CountingMember("a", None)
    counting = CountingMember("b", TokenCount(17, "worker"))
    pool = PoolAdapter([silent, counting], model="m", routing="least_load")
    assert await pool.count_tokens(ASKED, "count-1") == TokenCount(17, "worker")
    assert (silent.asked, counting.asked) == (1, 1)  # equal loads: the first member first
    assert all(m.in_flight == 0 for m in pool.members)  # nothing runs: nothing leased


async def test_members_that_do_not_count_are_skipped_and_none_left_is_none():
    plain, counting = Member("a"), CountingMember("b", TokenCount(5, "upstream"))
    pool = PoolAdapter([plain, counting], model="m", routing="least_load")
    for _ in range(3):
        assert await pool.count_tokens(ASKED, "count-1") == TokenCount(5, "upstream")
    assert await PoolAdapter([Member("c")], model="m").count_tokens(ASKED, "count-2") is None
