"""Load a local `sluice serve` with locust, headless, and say whether it held.

It writes a tenants file with three tenants (one with a low `rpm`, so 429s happen) and a key
each, starts `sluice serve` on a free loopback port with that file, waits for `/readyz`, runs
locustfile.py for `--run-time` seconds, stops the gateway, and prints locust's stats (with the
TTFT and ITL rows), a summary, and the gateway's own counters for the same things.

Exit status: 0 only if locust recorded no failure and no error, the gateway answered no 5xx and
logged no error, and every kind of request this load is about happened at least once (streams
with TTFT and ITL samples, cancels that cut a stream, resumes, idempotent repeats, expected
429s), as locust saw them and as the gateway counted them. The last line is `summary: {json}`,
for scripts.

    python deploy/locust/run_local.py                      # the default model, 60 s
    python deploy/locust/run_local.py --model tiny --run-time 20
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from gateway.backends.local_worker import free_port
from policies.tenants_file import create_key

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# Limits that differ per tenant; trickle's rpm is hit within seconds, the others never.
TENANTS = {
    "gold": {"rpm": 100000, "max_concurrent": 64, "max_tokens": 1024},
    "silver": {"rpm": 6000, "tpm": 5000000, "max_concurrent": 32, "max_tokens": 512},
    "trickle": {"rpm": 4, "max_concurrent": 4, "max_tokens": 512},
}
THROTTLED = ("trickle",)
# What must have happened at least once: (summary name, locust request type, name or None: any)
EXPECTED = (
    ("streams", "STREAM", None),
    ("ttft_samples", "TTFT", None),
    ("itl_samples", "ITL", None),
    ("cancels", "CANCEL", "stream ended cancelled"),
    ("resumes", "RESUME", None),
    ("idempotent_repeats", "REPLAY", None),
    ("expected_429s", "429", None),
)
# The gateway's side of the same (metric, labels it must have, summary name)
GATEWAY_COUNTS = (
    ("sluice_cancellations_total", {"source": "client"}, "gateway_client_cancels"),
    ("sluice_resumes_total", {}, "gateway_resumes"),
    ("sluice_idempotent_replays_total", {}, "gateway_idempotent_replays"),
    ("sluice_quota_rejections_total", {}, "gateway_quota_rejections"),
)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sluice-load-") as tmp:
        folder = Path(tmp)
        keys = write_tenants(folder / "tenants.toml")
        model = build_tiny(folder) if args.model == "tiny" else args.model
        port = free_port()
        root = f"http://127.0.0.1:{port}"
        log_path = folder / "serve.log"
        with log_path.open("wb") as log:
            serve = subprocess.Popen(
                serve_command(args, model, port, folder), stdout=log, stderr=log, env=serve_env()
            )
            try:
                if not wait_ready(serve, f"{root}/readyz", args.ready_timeout):
                    print(f"sluice serve did not become ready; its log:\n{tail(log_path)}")
                    return 2
                locust_rc = run_locust(args, root, keys, folder / "counts.json")
                gateway = gateway_counts(root)
            finally:
                stop(serve)
        errors = error_lines(log_path)
        summary = summarize(
            folder / "counts.json", locust_rc, {**gateway, "gateway_errors": len(errors)}
        )
        print_summary(summary)
        if not summary["ok"]:
            print(f"sluice serve's log:\n{tail(log_path)}")
        elif errors:
            print("sluice serve's errors:\n" + "\n".join(errors[-20:]))
        return 0 if summary["ok"] else 1


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model folder, or 'tiny' (the test model); default: serve's")
    p.add_argument("--users", type=int, default=8, help="locust users, 4 or more (default 8)")
    p.add_argument("--spawn-rate", type=float, help="users started per second (default: all)")
    p.add_argument("--run-time", type=int, default=60, help="seconds of load (default 60)")
    p.add_argument("--max-tokens", type=int, default=32, help="a plain stream's max_tokens")
    p.add_argument("--dtype", help="passed to sluice serve")
    p.add_argument("--device", help="passed to sluice serve")
    p.add_argument("--ready-timeout", type=float, default=300, help="seconds to wait for /readyz")
    args = p.parse_args(argv)
    if args.users < 4:
        p.error("--users must be at least 4: one of each kind of user")
    return args


def write_tenants(path: Path) -> dict[str, str]:
    """The tenants file, then a key per tenant (`sluice keys create` writes only its hash)."""
    lines = []
    for name, limits in TENANTS.items():
        lines.append(f"[tenants.{name}]")
        lines += [f"{field} = {value}" for field, value in limits.items()]
        lines.append('models = ["*"]\n')
    path.write_text("\n".join(lines), encoding="utf-8")
    return {name: create_key(path, name)[0] for name in TENANTS}


def build_tiny(folder: Path) -> str:
    sys.path.insert(0, str(ROOT))  # testkit/ is not installed
    from testkit.tiny_model import build_tiny_model

    return str(build_tiny_model(folder / "tiny-model"))


def serve_command(args: argparse.Namespace, model: str | None, port: int, folder: Path) -> list:
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)]
    cmd += ["--tenants", str(folder / "tenants.toml"), "--usage-file", str(folder / "usage.jsonl")]
    for flag, value in (("--model", model), ("--dtype", args.dtype), ("--device", args.device)):
        if value:
            cmd += [flag, value]
    return cmd


def serve_env() -> dict[str, str]:
    # a stop drains: runs still live after 2 s are cancelled, not after 30
    return {"SLUICE_LOG_LEVEL": "warning", **os.environ, "SLUICE_SHUTDOWN_TIMEOUT": "2"}


def wait_ready(proc: subprocess.Popen, url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)  # NOTE: polling another process's start, with a deadline
    return False


def run_locust(args: argparse.Namespace, root: str, keys: dict[str, str], counts: Path) -> int:
    env = {
        **os.environ,
        "SLUICE_LOAD_KEYS": ",".join(f"{name}={key}" for name, key in keys.items()),
        "SLUICE_LOAD_THROTTLED": ",".join(THROTTLED),
        "SLUICE_LOAD_MAX_TOKENS": str(args.max_tokens),
        "SLUICE_LOAD_COUNTS_FILE": str(counts),
    }
    cmd = [sys.executable, "-m", "locust", "-f", str(HERE / "locustfile.py"), "--headless"]
    cmd += ["-u", str(args.users), "-r", str(args.spawn_rate or args.users)]
    cmd += ["--run-time", f"{args.run_time}s", "--stop-timeout", "15", "--host", root]
    cmd += ["--only-summary"]
    try:
        return subprocess.run(cmd, env=env, timeout=args.run_time + 120, check=False).returncode
    except subprocess.TimeoutExpired:
        print("locust did not finish in time")
        return -1


def gateway_counts(root: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{root}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    counts = {}
    for metric, labels, name in GATEWAY_COUNTS:
        counts[name] = sum(
            s.value for s in samples if s.name == metric and labels.items() <= s.labels.items()
        )
    counts["gateway_5xx"] = sum(
        s.value
        for s in samples
        if s.name == "sluice_requests_total" and s.labels.get("code", "").startswith("5")
    )
    return counts


def error_lines(log: Path) -> list[str]:
    """Lines the gateway or its worker logged at error level or above (JSON log lines)."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            level = json.loads(line).get("level")
        except (ValueError, AttributeError):
            continue
        if level in ("error", "critical"):
            found.append(line)
    return found


def summarize(counts_file: Path, locust_rc: int, gateway: dict[str, float]) -> dict:
    counts = json.loads(counts_file.read_text()) if counts_file.exists() else {}
    rows = counts.get("rows", [])
    summary: dict = {"locust_exit": locust_rc}
    for name, kind, row_name in EXPECTED:
        summary[name] = sum(
            r["count"]
            for r in rows
            if r["type"] == kind and (row_name is None or r["name"] == row_name)
        )
    for name in ("requests", "failures", "exceptions"):
        summary[name] = counts.get(name, 0)
    summary.update({k: int(v) for k, v in gateway.items()})
    missing = [name for name, _, _ in EXPECTED if summary[name] == 0]
    missing += [name for _, _, name in GATEWAY_COUNTS if summary[name] == 0]
    summary["missing"] = missing
    summary["ok"] = (
        locust_rc == 0
        and bool(counts)
        and summary["failures"] == summary["exceptions"] == 0
        and summary["gateway_5xx"] == summary["gateway_errors"] == 0
        and not missing
    )
    return summary


def print_summary(summary: dict) -> None:
    print("\nsluicegate load summary")
    for key, value in summary.items():
        if key not in ("ok", "missing"):
            print(f"  {key:<28} {value:>8}")
    if summary["missing"]:
        print(f"  never happened: {', '.join(summary['missing'])}")
    print(f"result: {'ok' if summary['ok'] else 'FAILED'}")
    print(f"summary: {json.dumps(summary)}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


if __name__ == "__main__":
    sys.exit(main())
