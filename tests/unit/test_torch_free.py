"""The gateway's side of the house stays torch-free: every module of the gateway, its adapters,
policies and safety window, and the wire contract it shares with the workers imports in a
process where torch (and transformers) cannot be imported. `.ci/gateway-only` checks the same
by installing without torch; this catches it in the unit tier, before a wheel is built."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.process  # the import runs in a process of its own

_PROBE = r"""
import importlib, importlib.abc, pkgutil, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "transformers", "llguidance", "workers"}:
            raise ImportError(f"{name} imported from the torch-free side")
        return None

sys.meta_path.insert(0, NoTorch())
seen = 0
for top in ["wire", "common", "gateway", "adapters", "policies", "safety"]:
    package = importlib.import_module(top)
    for info in pkgutil.walk_packages(package.__path__, top + "."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
            seen += 1
from gateway.cli.main import build_parser
build_parser()  # the CLI's worker subcommand is built without importing the worker
print(seen)
"""


def test_gateway_imports_without_torch_or_the_workers_package():
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.strip()) > 80  # every module was walked, not an empty package
