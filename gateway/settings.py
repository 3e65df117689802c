"""Gateway settings: flags win over the environment (`SLUICE_<NAME>`), which wins over the
`--config` TOML file, which wins over the defaults below."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from gateway.runs.deadlines import Deadlines
from wire.limits import MAX_BODY_BYTES

DEFAULT_MODEL = "default"
SCHEDULINGS = ("fair", "fcfs")


@dataclass(slots=True, frozen=True)
class UpstreamSpec:
    """An OpenAI-compatible server serving model `name`; `capacity`: the runs it takes at once
    before it queues (design §12), None when unknown."""

    name: str
    url: str
    capacity: int | None = None


@dataclass(slots=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    workers: int = 1
    worker_url: list[str] = field(default_factory=list)
    upstream: list[str] = field(default_factory=list)
    # the config file's `[upstreams.NAME]` tables: url = "…", capacity = 64 (design §12)
    upstreams: dict[str, Any] = field(default_factory=dict)
    api_key: list[str] = field(default_factory=list)
    tenants: str | None = None
    redis_url: str | None = None
    redis_prefix: str = "sluice:"
    redis_max_connections: int = 256
    redis_timeout: float = 2.0  # seconds a Redis command may take before Redis counts as away
    redis_outage_grace: float = 30.0  # live runs ride out a Redis outage this long
    disconnect_grace: float = 10.0
    # deadlines in seconds, 0 = none; each one that fires is its own terminal cause
    queue_timeout: float = 120.0
    ttft_timeout: float = 0.0
    inter_token_timeout: float = 60.0
    total_timeout: float = 1800.0  # the name tenants use too
    slow_client_timeout: float = 30.0  # a stream unwritable this long is detached
    cancel_confirm_timeout: float = 5.0  # wait this long for the upstream to confirm a stop
    run_retention: float = 600.0  # seconds an ended run can still be retrieved and resumed
    run_max_events: int = 4096  # events kept per run for resume
    run_max_event_bytes: int = 8 << 20  # and at most this many bytes of them
    run_retention_bytes: int = 256 << 20  # ended runs kept in memory together (and, apart,
    # the endings kept with idempotency keys) hold at most this
    lease_ttl: float = 10.0  # with Redis: a replica silent this long has its runs failed
    idempotency_ttl: float = 86400.0  # seconds an Idempotency-Key keeps its run
    usage_file: str | None = None  # the JSONL usage ledger without Redis (default: state dir)
    default_max_tokens: int = 1024  # tokens reserved against tpm when a request names no max
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout: float = 30.0  # a request head or body slower than this is answered 408
    max_pending_connections: int = 1024  # connections without a whole request (head and body)
    keepalive_timeout: float = 75.0  # an idle keep-alive connection is closed after this
    ping_interval: float = 15.0
    stall_timeout: float = 10.0  # a pool member with work and no engine step this long is hung
    shutdown_timeout: float = 30.0  # on SIGTERM, live runs get this long to finish
    pool_routing: str = "affinity"  # affinity | least_load | random (adapters/pool_routing.py)
    # fair: saturated backends' runs wait in fair queues here, and local workers schedule by
    # tier and tenant; fcfs: runs go as they come (design §12)
    scheduling: str = "fair"
    worker_start_timeout: float = 300.0
    follow_token_ttl: float = 3600.0  # seconds a run's follow token lets a browser read it
    follow_token_secret: str | None = None  # env or --config only (gateway/http/follow_access.py)
    cors_origin: list[str] = field(default_factory=list)  # browser origins allowed (or "*")
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.scheduling not in SCHEDULINGS:
            raise ValueError(f"scheduling must be one of {', '.join(SCHEDULINGS)}")

    @property
    def starts_local_workers(self) -> bool:
        """design §9: a local worker unless only remote backends were named."""
        return self.model is not None or not (self.worker_url or self.upstream or self.upstreams)

    def deadlines(self, overrides: dict[str, float] | None = None) -> Deadlines:
        """The run deadlines; a tenant's own values (`queue_timeout`, …) replace the defaults."""
        o = overrides or {}

        def limit(name: str, default: float) -> float | None:
            seconds = o.get(name, default)
            return seconds if seconds > 0 else None

        return Deadlines(
            queue=limit("queue_timeout", self.queue_timeout),
            ttft=limit("ttft_timeout", self.ttft_timeout),
            inter_token=limit("inter_token_timeout", self.inter_token_timeout),
            total=limit("total_timeout", self.total_timeout),
        )

    def upstream_specs(self) -> list[UpstreamSpec]:
        """`--upstream NAME=BASE_URL[#capacity=N]`, then the config file's `[upstreams.NAME]`
        tables, validated."""
        specs = [_upstream_flag(spec) for spec in self.upstream]
        for name, table in self.upstreams.items():
            if not isinstance(table, dict) or set(table) - {"url", "capacity"}:
                raise ValueError(f"[upstreams.{name}] takes url and capacity only")
            url, capacity = table.get("url"), table.get("capacity")
            specs.append(UpstreamSpec(name, _upstream_url(name, url), _capacity(name, capacity)))
        return specs


def _upstream_flag(spec: str) -> UpstreamSpec:
    name, sep, rest = spec.partition("=")
    url, hashed, option = rest.partition("#")
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise ValueError(f"--upstream expects NAME=BASE_URL[#capacity=N], got {spec!r}")
    capacity = None
    if hashed:
        key, eq, value = option.partition("=")
        if key != "capacity" or not eq or not value.isdigit():
            raise ValueError(f"--upstream takes #capacity=N after the URL, got {spec!r}")
        capacity = _capacity(name, int(value))
    return UpstreamSpec(name, url, capacity)


def _upstream_url(name: str, url: object) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"[upstreams.{name}] url must be an http(s) base URL, got {url!r}")
    return url


def _capacity(name: str, capacity: object) -> int | None:
    if capacity is None:
        return None
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"upstream {name!r}: capacity must be a positive integer")
    return capacity


def _coerce(value: str, like: Any, is_list: bool) -> Any:
    if is_list:
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(like, bool):
        return value.lower() in ("1", "true", "yes", "on")
    if isinstance(like, int):
        return int(value)
    if isinstance(like, float):
        return float(value)
    return value


def load_settings(flags: dict[str, Any], environ: dict[str, str] | None = None) -> Settings:
    """Merge flags (None = not given), `SLUICE_*` variables and the `--config` file."""
    environ = os.environ if environ is None else environ
    config_path = flags.get("config") or environ.get("SLUICE_CONFIG")
    config: dict[str, Any] = {}
    if config_path:
        with Path(config_path).open("rb") as fh:
            config = {k.replace("-", "_"): v for k, v in tomllib.load(fh).items()}
    defaults = Settings()
    values: dict[str, Any] = {}
    for f in fields(Settings):
        default = getattr(defaults, f.name)
        is_list = isinstance(default, list)
        flag = flags.get(f.name)
        env = environ.get(f"SLUICE_{f.name.upper()}")
        if flag not in (None, []):
            values[f.name] = flag
        elif env is not None:
            values[f.name] = _coerce(env, default, is_list)
        elif f.name in config:
            values[f.name] = config[f.name]
    return Settings(**values)
