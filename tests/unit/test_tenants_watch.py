"""Reloading the tenants file while serving: changes picked up, broken files never applied."""

from __future__ import annotations

import asyncio
from pathlib import Path

import structlog

from policies.auth import hash_key
from policies.tenants import TenantsConfig, TenantsFileError
from policies.tenants_watch import reload_now, watch_tenants
from tests.support.waiting import until

INTERVAL = 0.05


async def wait_for(condition) -> None:
    await until(condition, "the watcher to act")


async def test_a_changed_file_is_picked_up_within_a_couple_of_intervals(tmp_path: Path):
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.a]\n")
    seen: list[TenantsConfig] = []
    task = asyncio.create_task(watch_tenants(path, seen.append, interval=INTERVAL))
    try:
        await asyncio.sleep(INTERVAL * 2)  # NOTE: an absence can only be seen over time
        assert seen == []  # nothing changed yet
        path.write_text("[tenants.a]\n[tenants.b]\n")
        await wait_for(lambda: seen)
        assert list(seen[-1].tenants) == ["a", "b"]
    finally:
        task.cancel()


async def test_a_broken_file_keeps_the_previous_config(tmp_path: Path):
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.a]\n")
    seen: list[TenantsConfig] = []
    task = asyncio.create_task(watch_tenants(path, seen.append, interval=INTERVAL))
    try:
        await asyncio.sleep(INTERVAL * 2)  # NOTE: the watcher has read the first version
        with structlog.testing.capture_logs() as logs:
            path.write_text('[tenants.a]\nkeys = ["sk-sluice-pasted-by-mistake"]\n')
            await wait_for(lambda: any(e["log_level"] == "error" for e in logs))
        assert seen == []
        (failure,) = [e for e in logs if e["log_level"] == "error"]
        assert failure["path"] == str(path) and "keys[0]" in failure["error"]
        assert "pasted-by-mistake" not in str(failure)

        path.write_text(f'[tenants.a]\nkeys = ["{hash_key("sk-sluice-good")}"]\n')
        await wait_for(lambda: seen)
        assert len(seen[-1].tenants["a"].keys) == 1
    finally:
        task.cancel()


def test_reload_now_reports_whether_the_new_config_was_applied(tmp_path: Path):
    path = tmp_path / "tenants.toml"
    seen: list[TenantsConfig] = []
    assert not reload_now(path, seen.append)  # no file yet
    path.write_text("[tenants.a]\nrpm = 0\n")
    assert not reload_now(path, seen.append)
    path.write_text("[tenants.a]\nrpm = 10\n")
    assert reload_now(path, seen.append)
    assert seen[-1].tenants["a"].limits.rpm == 10


def test_reload_now_keeps_the_old_config_when_the_receiver_refuses_the_new_one(tmp_path: Path):
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.a]\n")

    def refuse(_config: TenantsConfig) -> None:
        raise TenantsFileError("[jwt]: field 'hs256_secret_env': environment variable X is not set")

    assert not reload_now(path, refuse)
