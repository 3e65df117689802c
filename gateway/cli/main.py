"""The `sluice` command line: `serve`, `worker`, `usage`, `keys`, `audit`, `tenants` (design §9).

`serve`'s flags here and the settings dataclass (gateway/settings.py) are what
docs/reference/serve.md is generated from (gateway/cli/reference.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

from aiohttp import web

from adapters.pool_routing import ROUTINGS
from common.config import ConfigError
from common.logs import configure_logging
from common.worker_settings import DEVICES, DTYPES, SERVE_ENGINE_FLAGS, add_engine_arguments
from gateway.eager_tasks import start_request_writes_eagerly
from gateway.event_loop import loop_factory
from gateway.gc_policy import settle_for_serving
from gateway.http.server import GatewayRunner
from gateway.settings import LOG_LEVELS, SCHEDULINGS, TENANTS_STORES, Settings, load_settings
from policies.auth import generate_key


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Every `sluice serve` flag (each `dest` a Settings field, or an engine setting for the
    local workers); none has a default of its own (a list's is empty), so the loader can tell
    a flag given."""
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (default 8000)")
    p.add_argument("--model", help="local HF model folder, or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="the local workers' weights and activations (auto: bf16 where the hardware has it "
        "natively, else fp16 on CUDA, fp32 on CPU)",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        help="where the local workers run (auto: cuda if present)",
    )
    p.add_argument("--workers", type=int, help="local worker processes to start (default 1)")
    p.add_argument("--worker-url", action="append", default=[], help="a running sluice worker")
    p.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="NAME=BASE_URL[#capacity=N]",
        help="an OpenAI-compatible server that serves model NAME; #capacity=N: the runs it "
        "takes at once, beyond which they wait in this gateway's fair queues",
    )
    p.add_argument(
        "--scheduling",
        choices=list(SCHEDULINGS),
        help="fair (the default): runs for a saturated backend wait in per-tenant queues here, "
        "by tier and weight, and local workers schedule the same way; fcfs: as they come",
    )
    _add_run_arguments(p)
    _add_connection_arguments(p)
    _add_browser_arguments(p)
    _add_trace_arguments(p)
    engine = p.add_argument_group(
        "local workers' engine", "handed to each local worker; also the config's [worker] table"
    )
    add_engine_arguments(engine, SERVE_ENGINE_FLAGS)
    p.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file with any of these settings (keys: their names; the local workers' "
        "engine settings in a [worker] table); an unknown key is an error",
    )
    p.add_argument("--log-level", choices=LOG_LEVELS, help="least level logged")


def _add_browser_arguments(p: argparse.ArgumentParser) -> None:
    """What browsers may do: follow a run by its token, call from other origins."""
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a browser origin (scheme://host[:port], or '*') allowed to call the API; "
        "repeatable; none by default",
    )
    p.add_argument(
        "--follow-token-ttl",
        type=float,
        help="seconds a run's follow token (?token=) can read it (default 3600); its secret "
        "comes from SLUICE_FOLLOW_TOKEN_SECRET",
    )


def _add_trace_arguments(p: argparse.ArgumentParser) -> None:
    """OpenTelemetry traces of runs (docs/tracing.md)."""
    p.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="export a trace per run (OTLP/HTTP protobuf to URL/v1/traces, e.g. "
        "http://collector:4318); the local workers export their spans there too; off by default",
    )
    p.add_argument(
        "--trace-sample-ratio",
        type=float,
        metavar="RATIO",
        help="share of runs traced, by trace id (default 1.0); a caller's traceparent decides "
        "for its own runs",
    )


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Tenants, state, a run's deadlines and retention."""
    p.add_argument("--api-key", action="append", default=[], help="accepted bearer key")
    p.add_argument("--tenants", help="tenants TOML file")
    p.add_argument(
        "--tenants-store",
        choices=list(TENANTS_STORES),
        help="where tenants live: file (the --tenants file, edited in place by the admin API; "
        "the default) or redis (shared by every replica on --redis-url; the file is pushed "
        "there once, then ignored)",
    )
    p.add_argument(
        "--admin-key",
        action="append",
        default=[],
        help="a bearer key of the admin API (/admin); repeatable; none: only a JWT with the "
        "sluice-admin role, and without [jwt] the admin API answers 404",
    )
    p.add_argument("--redis-url", help="Redis for state shared by replicas")
    p.add_argument("--redis-prefix", help="key prefix in Redis (default 'sluice:')")
    p.add_argument(
        "--redis-outage-grace",
        type=float,
        help="seconds live runs ride out a Redis outage before ending (default 30)",
    )
    p.add_argument("--disconnect-grace", type=float, help="seconds a run outlives its client")
    p.add_argument("--queue-timeout", type=float, help="seconds to wait for admission (0: none)")
    p.add_argument("--ttft-timeout", type=float, help="seconds to the first token (0: none)")
    p.add_argument("--inter-token-timeout", type=float, help="seconds between tokens (0: none)")
    p.add_argument("--total-timeout", type=float, help="seconds for a whole run (0: none)")
    p.add_argument("--slow-client-timeout", type=float, help="detach a stream unwritable this long")
    p.add_argument("--run-retention", type=float, help="seconds an ended run stays resumable")
    p.add_argument(
        "--run-retention-bytes",
        type=int,
        help="bytes ended runs may hold in memory together (default 256 MiB; oldest go first)",
    )
    p.add_argument(
        "--redis-timeout", type=float, help="seconds a Redis command may take (default 2)"
    )
    p.add_argument("--idempotency-ttl", type=float, help="seconds an Idempotency-Key lives (24 h)")
    p.add_argument("--usage-file", help="JSONL usage ledger when there is no Redis")


def _add_connection_arguments(p: argparse.ArgumentParser) -> None:
    """Connections and streams, the pool's routing and retries, and shutdown."""
    p.add_argument("--max-body-bytes", type=int, help="largest request body (default 4 MiB)")
    p.add_argument(
        "--body-timeout", type=float, help="seconds to receive a request head or body (408)"
    )
    p.add_argument(
        "--max-pending-connections",
        type=int,
        help="connections still sending a request, head or body (default 1024; oldest go first)",
    )
    p.add_argument("--ping-interval", type=float, help="seconds of idle stream before a ': ping'")
    p.add_argument(
        "--stall-timeout",
        type=float,
        help="seconds a pool member may have work and take no engine step before it is ejected "
        "(and, if local, restarted); default 10",
    )
    p.add_argument(
        "--pool-routing",
        choices=list(ROUTINGS),
        help="how a pool picks a member: affinity (prefix cache, bounded by load; the default), "
        "least_load, random",
    )
    p.add_argument(
        "--retry-budget",
        type=float,
        metavar="SHARE",
        help="retries of requests that failed before their first event (on another member) are "
        "at most this share of requests over a sliding 10 s window, and at least 10 per window "
        "(default 0.2; 0: no retries)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        help="seconds live runs get to finish after SIGTERM/SIGINT before they are cancelled "
        "(default 30)",
    )


def _banner(settings: Settings, key: str, model: str) -> str:
    """The generated key and a snippet for `model`, the first model the gateway serves."""
    base = f"http://{settings.host}:{settings.port}/v1"
    return f"""
sluicegate is serving on {base}
No --api-key given, so one was generated for this run:

    {key}

Try it:

    from openai import OpenAI
    client = OpenAI(base_url="{base}", api_key="{key}")
    stream = client.chat.completions.create(
        model="{model}",
        messages=[{{"role": "user", "content": "What is the capital of France?"}}],
        temperature=0,
        stream=True,
    )
    for chunk in stream:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
"""


async def _serve(settings: Settings, generated_key: str | None) -> None:
    from gateway.app import create_app
    from gateway.app_keys import CATALOG, DRAIN, OPEN_STREAMS, RUNS

    app = create_app(settings)
    # NOTE: aiohttp's access log formats a plain-text line per request; the structured
    # "run end" line already records each run, so the access log is only kept for debug.
    access_log = logging.getLogger("aiohttp.access") if settings.log_level == "debug" else None
    runner = GatewayRunner(
        app,
        header_timeout=settings.body_timeout,
        max_pending=settings.max_pending_connections,
        handler_cancellation=True,
        shutdown_timeout=5,
        access_log=access_log,
        keepalive_timeout=settings.keepalive_timeout,
    )
    await runner.setup()  # starts the workers and adapters
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    settle_for_serving()  # NOTE: after start-up, so what it built is frozen (gateway/gc_policy.py)
    loop = asyncio.get_running_loop()
    start_request_writes_eagerly(loop)  # upstream requests leave at once
    if generated_key:
        models = app[CATALOG].models()
        print(_banner(settings, generated_key, models[0].id if models else "…"), flush=True)
    on = type(loop).__module__.partition(".")[0]  # the loop it runs on: uvloop or asyncio
    print(f"sluicegate ready on http://{settings.host}:{settings.port} ({on})", flush=True)
    stop = asyncio.Event()
    drain = app[DRAIN]

    def on_signal() -> None:
        if stop.is_set():
            drain.hurry()  # a second signal: cancel the live runs now
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        await stop.wait()
        # NOTE: the drain runs while the site still listens, so /readyz says "draining" and
        # new requests get a 503 to retry elsewhere; aiohttp's shutdown comes after it.
        await drain.run(app[RUNS], app[OPEN_STREAMS])
    finally:
        await runner.cleanup()


def cmd_serve(args: argparse.Namespace) -> int:
    flags: dict[str, Any] = {k: v for k, v in vars(args).items() if k not in ("cmd", "func")}
    try:
        settings = load_settings(flags)
        new_loop = loop_factory(settings.event_loop)
    except ConfigError as exc:
        print(f"sluice serve: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    key = None
    if not settings.api_key and not settings.tenants:
        key = generate_key()
        settings.api_key = [key]
    try:
        with asyncio.Runner(loop_factory=new_loop) as runner:
            runner.run(_serve(settings, key))
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"sluice serve: {exc}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="run the gateway (and, by default, one local worker)")
    add_serve_arguments(serve)
    serve.set_defaults(func=cmd_serve)
    # `sluice worker …` is handed whole to workers.cli (see main), so the gateway process never
    # imports torch; this entry only lists it in `sluice --help`.
    sub.add_parser("worker", help="run one model worker (sluice worker --help for its flags)")
    sub.add_parser("usage", help="token totals per tenant and model from the usage ledger")
    sub.add_parser("keys", help="create, list or revoke API keys (sluice keys --help)")
    sub.add_parser("audit", help="the audit log of tenant and key changes (sluice audit --help)")
    sub.add_parser("tenants", help="move tenants between the file and Redis: push | pull")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        from workers.cli import main as worker_main

        return worker_main(argv[1:], prog="sluice worker")
    if argv[:1] == ["usage"]:
        from gateway.cli.usage import main as usage_main

        return usage_main(argv[1:])
    if argv[:1] == ["keys"]:
        from gateway.admin.cli import record_key_change
        from policies.keys_cli import main as keys_main

        return keys_main(argv[1:], on_change=record_key_change)
    if argv[:1] == ["audit"]:
        from gateway.admin.cli import audit_main

        return audit_main(argv[1:])
    if argv[:1] == ["tenants"]:
        from gateway.admin.cli import tenants_main

        return tenants_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
