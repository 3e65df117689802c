"""The serving gateway's collector settings: start-up's objects frozen, a larger young generation,
and collection still on (cycles made while serving are freed)."""

from __future__ import annotations

import gc
import weakref

import pytest

from gateway.gc_policy import GEN0_THRESHOLD, settle_for_serving


@pytest.fixture
def collector():
    """Puts the collector back as it was: the rest of the test run is not a server."""
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_start_up_objects_are_frozen_and_the_young_generation_is_larger(collector):
    built_at_start_up = Node()
    settle_for_serving()
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold()[0] == GEN0_THRESHOLD > 700
    walked = {id(obj) for obj in gc.get_objects()}  # every generation a collection walks
    assert id(built_at_start_up) not in walked
    made_after = Node()
    assert id(made_after) in {id(obj) for obj in gc.get_objects()}


def test_cycles_made_while_serving_are_still_collected(collector):
    settle_for_serving()
    gone = weakref.ref(Node())
    assert gone() is not None
    gc.collect()
    assert gone() is None
