"""`sluice keys`: through the real `sluice` entry point, into a real tenants file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from policies.auth import Authenticator
from policies.tenants import load_tenants

pytestmark = pytest.mark.process  # each test runs `sluice keys`


def sluice_keys(*args: str, cwd: Path, env: dict[str, str] | None = None):
    environ = {k: v for k, v in os.environ.items() if k != "SLUICE_TENANTS"}
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "keys", *args],
        cwd=cwd,
        env={**environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_create_list_authenticate_revoke(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text("# hand-written\n[tenants.acme]\nrpm = 60\n")

    created = sluice_keys("create", "--tenant", "acme", "--tenants", str(path), cwd=tmp_path)
    assert created.returncode == 0, created.stderr
    lines = created.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("sk-sluice-")
    key = lines[0]
    config = load_tenants(path)
    (entry,) = config.tenants["acme"].keys
    assert entry.id in created.stderr and str(path) in created.stderr
    assert key not in created.stderr
    assert key.encode() not in path.read_bytes()

    listed = sluice_keys("list", "--tenants", str(path), cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[0].split() == ["ID", "TENANT", "CREATED"]
    assert listed.stdout.splitlines()[1].split() == [entry.id, "acme", entry.created]
    assert key not in listed.stdout and entry.hash.removeprefix("sha256:") not in listed.stdout

    principal = Authenticator(config).authenticate(f"Bearer {key}")
    assert principal is not None and (principal.tenant, principal.key_id) == ("acme", entry.id)

    revoked = sluice_keys("revoke", entry.id, "--tenants", str(path), cwd=tmp_path)
    assert revoked.returncode == 0, revoked.stderr
    assert Authenticator(load_tenants(path)).authenticate(f"Bearer {key}") is None
    assert path.read_text().startswith("# hand-written\n")

    again = sluice_keys("revoke", entry.id, "--tenants", str(path), cwd=tmp_path)
    assert again.returncode == 1 and entry.id in again.stderr


def test_the_file_defaults_to_sluice_tenants_then_tenants_toml_here(tmp_path):
    made = sluice_keys("create", "--tenant", "a", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert list(load_tenants(tmp_path / "tenants.toml").tenants) == ["a"]

    elsewhere = tmp_path / "conf" / "t.toml"
    elsewhere.parent.mkdir()
    env = {"SLUICE_TENANTS": str(elsewhere)}
    assert sluice_keys("create", "--tenant", "b", cwd=tmp_path, env=env).returncode == 0
    assert list(load_tenants(elsewhere).tenants) == ["b"]
    listed = sluice_keys("list", cwd=tmp_path, env=env)
    assert " b " in listed.stdout and " a " not in listed.stdout


def test_a_broken_file_is_reported_and_left_alone(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.acme]\nrmp = 60\n")
    result = sluice_keys("create", "--tenant", "acme", "--tenants", str(path), cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout == ""
    assert "tenant 'acme': field 'rmp'" in result.stderr
    assert path.read_text() == "[tenants.acme]\nrmp = 60\n"
