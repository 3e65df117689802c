"""The tier rules (tests/support/tiers.py): a test's folder, fixtures, parameters and marks put it
in the redis, process and browser tiers, so `make test-fast` never reaches Redis, starts a
process or drives a browser."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.tiers import TESTS, tiers


def item(where: str, *fixtures: str, params: dict | None = None, marks: tuple[str, ...] = ()):
    """What `tiers` reads of a collected test."""
    return SimpleNamespace(
        path=TESTS / where,
        fixturenames=list(fixtures),
        callspec=SimpleNamespace(params=params) if params is not None else None,
        iter_markers=lambda: [SimpleNamespace(name=name) for name in marks],
    )


@pytest.mark.parametrize(
    ("test", "expected"),
    [
        (item("unit/test_sse.py", "aiohttp_client"), set()),
        (item("e2e/test_shutdown.py"), {"process"}),
        (item("browser/test_playground.py", "proxy"), {"browser", "process"}),
        (item("unit/test_engine.py", "tiny", "tiny_model_dir"), {"process"}),
        (item("unit/test_run_store.py", "redis_space"), {"redis"}),
        (item("unit/test_redis_client.py", "private_redis"), {"redis", "process"}),
        (item("integration/test_default_model.py", marks=("default_model",)), {"process"}),
    ],
)
def test_folders_fixtures_and_marks_name_the_tier(test, expected):
    assert tiers(test) == expected


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"store_settings": "memory"}, set()),
        ({"store_settings": "redis"}, {"redis"}),
        ({"store": "mirrored", "moves": (1, -1)}, {"redis"}),
        ({"ledger": "jsonl", "count": 3}, set()),
    ],
)
def test_a_store_parametrized_onto_redis_needs_it_and_its_memory_twin_not(params, expected):
    assert tiers(item("unit/test_run_store.py", params=params)) == expected


def test_a_test_outside_the_tests_folder_is_classified_by_the_rest():
    outside = item("unit/test_x.py", "tiny_model_dir")
    outside.path = Path("/elsewhere/test_x.py")
    assert tiers(outside) == {"process"}
