"""Routing in a real `sluice serve --workers 2` on the tiny model (design §6): concurrent
requests spread over both members, and a repeated long prompt goes back to the member that
holds it, where it hits the prefix cache."""

from __future__ import annotations

import concurrent.futures

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.test_pool_faults import healthy_members
from tests.e2e.test_worker_faults import chat
from tests.support.serve import Served, serving
from tests.support.waiting import until_sync

# several prefix-affinity blocks (256 characters) and many KV blocks (16 tokens)
LONG = "Summarise the following notes on the history of paged attention, block by block. " * 12


def requests_by_member(gateway: Served) -> dict[str, float]:
    """`sluice_member_requests_total` by member (`local:PORT`)."""
    text = httpx.get(f"{gateway.root}/metrics").text
    return {
        s.labels["member"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "sluice_member_requests_total"
    }


def prefix_cache_hits(member: str) -> int:
    port = member.rsplit(":", 1)[1]
    return httpx.get(f"http://127.0.0.1:{port}/v1/stats").json()["prefix_cache_hits"]


def ask_long(gateway: Served) -> str:
    """Send the long prompt; the member it went to."""
    before = requests_by_member(gateway)
    answer = chat(gateway, messages=[{"role": "user", "content": LONG}], max_tokens=2)
    assert answer.status_code == 200, answer.text
    after = requests_by_member(gateway)
    (member,) = [m for m, n in after.items() if n > before.get(m, 0)]
    return member


def test_concurrent_requests_spread_and_a_repeated_prompt_hits_its_members_cache(
    tiny_model_dir,
):
    with serving(tiny_model_dir, "--workers", "2") as gateway:
        until_sync(lambda: healthy_members(gateway) == 2, "both members to be healthy")
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(
                pool.map(
                    lambda i: chat(
                        gateway, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=8
                    ),
                    range(8),
                )
            )
        assert [a.status_code for a in answers] == [200] * 8
        spread = requests_by_member(gateway)
        assert len(spread) == 2 and all(n > 0 for n in spread.values()), spread

        holder = ask_long(gateway)
        hits = prefix_cache_hits(holder)
        assert [ask_long(gateway) for _ in range(3)] == [holder] * 3
        assert prefix_cache_hits(holder) > hits
