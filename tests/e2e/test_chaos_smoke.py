"""`bench/chaos.py --quick`: three scripted OpenAI-compatible members faulting at random, then
one of them down, behind a real `sluice serve`, driven by the real `openai` client.

The bench prints a table and a verdict line per target for each cell; the test reads them all
and holds the one that must never fail: no client saw an error while healthy members were
left (the faults cell), and every run got one usage record.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

# alone (tests/support/tiers.py): it loads the host by design
pytestmark = pytest.mark.alone

BENCH = Path(__file__).resolve().parents[2] / "bench" / "chaos.py"
VERDICT = re.compile(r"^ *(met|NOT MET)  (.+): (.+)$")


def cells(output: str) -> dict[str, list[tuple[bool, str, str]]]:
    """Each cell's verdicts, (met, target, figure), by the cell's name (its heading's word)."""
    found: dict[str, list[tuple[bool, str, str]]] = {}
    cell = None
    for line in output.splitlines():
        if line.startswith(("faults: ", "down: ")):
            cell = line.split(":")[0]
            found[cell] = []
        elif (match := VERDICT.match(line)) and cell is not None:
            met, target, figure = match.groups()
            found[cell].append((met == "met", target, figure))
    return found


@pytest.mark.slow
def test_the_quick_chaos_run_reports_every_target_and_no_client_error(tmp_path):
    began = time.monotonic()
    cmd = [sys.executable, str(BENCH), "--quick", "--logdir", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    verdicts = cells(output)
    assert set(verdicts) == {"faults", "down"}, output[-4000:]
    assert len(verdicts["faults"]) == 4 and len(verdicts["down"]) == 3, output[-4000:]
    faults = {target: (met, figure) for met, target, figure in verdicts["faults"]}
    errors = faults["0 client-visible errors while a healthy member exists"]
    assert errors == (True, "0"), output[-4000:]
    records = faults["every run one terminal state and one usage record"]
    assert records[0], output[-4000:]
    assert time.monotonic() - began < 200
