"""Responses on two gateway replicas sharing Redis (one real worker, the tiny model): a
background response started on one replica is read, resumed from any sequence number,
cancelled and deleted on the other, with the same numbered events on both."""

from __future__ import annotations

import openai
import pytest

from tests.integration import test_two_replicas as two
from tests.support.waiting import until_sync

# the two replicas, their worker and model: the fixtures of test_two_replicas, shared here
prefix, worker, start_replica = two.prefix, two.worker, two.start_replica
replicas, replica_a, replica_b, model = two.replicas, two.replica_a, two.replica_b, two.model

PROMPT = "Tell me a story about 你好 and café."


def ended(client, response_id: str):
    response = client.responses.retrieve(response_id)
    return response if response.status not in ("queued", "in_progress") else None


def test_a_background_response_reads_and_resumes_the_same_on_both(replica_a, replica_b, model):
    a, b = replica_a.client(), replica_b.client()
    created = a.responses.create(
        model=model, input=PROMPT, temperature=0, max_output_tokens=60, background=True
    )
    done = until_sync(lambda: ended(b, created.id), "the response to end on B", within=30)
    assert done.status == "incomplete" and done.output_text
    on_a_now = a.responses.retrieve(created.id).model_dump()
    on_b_then = done.model_dump()
    # NOTE: each read issues its own follow token, which carries its expiry second: two reads
    # either side of a second's turn differ there and nowhere else
    assert on_a_now.pop("follow_token").startswith("f1.")
    assert on_b_then.pop("follow_token").startswith("f1.")
    assert on_a_now == on_b_then
    on_a = list(a.responses.retrieve(created.id, stream=True))
    on_b = list(b.responses.retrieve(created.id, stream=True))
    assert [e.model_dump() for e in on_a] == [e.model_dump() for e in on_b]
    assert [e.sequence_number for e in on_a] == list(range(len(on_a)))
    for after in (0, len(on_a) // 2, len(on_a) - 2):
        rest = list(b.responses.retrieve(created.id, stream=True, starting_after=after))
        assert [e.model_dump() for e in rest] == [e.model_dump() for e in on_a[after + 1 :]]


def test_cancel_and_delete_on_b_of_a_response_driven_by_a(replica_a, replica_b, model, worker):
    a, b = replica_a.client(), replica_b.client()
    created = a.responses.create(
        model=model, input=PROMPT, temperature=0, max_output_tokens=900, background=True
    )
    until_sync(lambda: b.responses.retrieve(created.id).output_text, "text on B", within=30)
    assert b.responses.cancel(created.id).status == "cancelled"
    assert two.worker_idle(worker)["kv_blocks_used"] == 0
    b.responses.delete(created.id)
    for client in (a, b):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(created.id)
