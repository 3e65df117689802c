"""The test tiers: which tests need the real Redis, start processes, drive a browser, or are slow.

`make test-fast` runs none of them (no Redis, no processes, no browser, under a minute); `make
test` runs them all. The marks come from what a test uses, so a new test lands in its tier
without a decorator:

- its folder: tests/browser drives a browser against a real `sluice serve`, tests/e2e starts one;
- its fixtures: the tiny checkpoint (built on disk, then loaded by the engine or a worker), a
  scripted upstream or a private redis-server (processes), a Redis client and key prefix;
- its parameters: the backends of a store fixture that live in Redis (`redis`, `mirrored`);
- `default_model`: it loads the real default model.

A test that reaches Redis or starts a process some other way (a CLI run as a subprocess, a Redis
client made in its body) carries `@pytest.mark.redis` or `@pytest.mark.process` itself, or its
module's `pytestmark` does; `slow` is always written on the test.

`alone` is written on the module too: `make test` runs the rest of the suite on two processes
(pytest-xdist, a module per process at a time) and then the `alone` tests by themselves. A test
is `alone` when it loads the host by design (the soak, the chaos and locust smokes) or times how
soon a killed, hung or stopped process (a worker, a member, Redis) is noticed or back: beside
another module's processes on a 2-core host, a member restarted within the test's 60 s took 45.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

BY_FOLDER = {"browser": ("browser", "process"), "e2e": ("process",)}
BY_FIXTURE = {
    "tiny_model_dir": ("process",),
    "scripted_upstream": ("process",),
    "served": ("process",),  # a `sluice serve` (and its workers) started for the module
    "private_redis": ("redis", "process"),
    "start_replica": ("redis", "process"),  # gateway processes sharing the real Redis
    "redis_space": ("redis",),
    "redis_prefix": ("redis",),
    "redis_backend": ("redis",),
}
REDIS_BACKENDS = {"redis", "mirrored"}  # a parametrized store's values that live in Redis
BY_MARK = {"default_model": ("process",)}


def tiers(item: pytest.Item) -> set[str]:
    """The tier marks `item` gets from its folder, fixtures, parameters and marks."""
    found: set[str] = set()
    if item.path.is_relative_to(TESTS):
        found.update(BY_FOLDER.get(item.path.relative_to(TESTS).parts[0], ()))
    for name in getattr(item, "fixturenames", ()):
        found.update(BY_FIXTURE.get(name, ()))
    callspec = getattr(item, "callspec", None)
    if callspec is not None and REDIS_BACKENDS.intersection(
        v for v in callspec.params.values() if isinstance(v, str)
    ):
        found.add("redis")
    for mark in item.iter_markers():
        found.update(BY_MARK.get(mark.name, ()))
    return found


def mark_tiers(items: list[pytest.Item]) -> None:
    for item in items:
        have = {mark.name for mark in item.iter_markers()}
        for name in sorted(tiers(item) - have):
            item.add_marker(name)
