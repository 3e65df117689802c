"""Gateway settings: flags win over the environment (`SLUICE_<NAME>`), which wins over the
`--config` TOML file, which wins over the defaults below (common/config.py, the loader the workers
use too). A setting without a flag carries its help here; the others', on their flag
(gateway/cli/main.py); docs/reference/serve.md is generated from both."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from adapters.fallback_route import Alias, parse_aliases
from adapters.pool_routing import ROUTINGS
from common.config import ConfigError, build, check_keys, config_file, describe, resolve, setting
from common.worker_settings import (
    DEVICES,
    DTYPES,
    ENGINE_KEYS,
    SCHEDULINGS,
    WorkerConfig,
    check_kv_sizing,
    check_otlp_endpoint,
    worker_settings,
)
from gateway.event_loop import EVENT_LOOPS
from gateway.prices import Price, parse_prices
from gateway.runs.deadlines import Deadlines
from wire.limits import MAX_BODY_BYTES

DEFAULT_MODEL = "default"
LOG_LEVELS = ("debug", "info", "warning", "error")
TENANTS_STORES = ("file", "redis")
# the settings that take one of a few words (their flags offer the same choices)
_CHOICES = {
    "dtype": DTYPES,
    "device": DEVICES,
    "pool_routing": ROUTINGS,
    "scheduling": SCHEDULINGS,
    "log_level": LOG_LEVELS,
    "tenants_store": TENANTS_STORES,
    "event_loop": EVENT_LOOPS,
}
# what a `[worker]` table may not set, and why: the gateway sets it from its own settings
_SET_BY_SERVE = {
    "model": "set it at the top level",
    "device": "set it at the top level",
    "dtype": "set it at the top level",
    "scheduling": "set it at the top level",
    "max_body_bytes": "the gateway sets it from its own max_body_bytes",
    "host": "sluice serve chooses it",
    "port": "sluice serve chooses it",
}


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
    upstreams: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": 'the config file\'s `[upstreams.NAME]` tables: `url = "…"`, `capacity = 64` '
            "(as --upstream NAME=URL#capacity=64)"
        },
    )
    models: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": 'the config file\'s `[models."ALIAS"]` tables, model aliases: `targets = '
            '["a", "b"]` (tried in order) or `[{model = "a", weight = 90}, …]` (weighted, '
            "sticky per conversation), `first_token_timeout = 5` (seconds a target may take "
            "to its first token before the next is tried); see docs/routing.md"
        },
    )
    prices: dict[str, Any] = field(
        default_factory=dict,
        metadata={
            "help": 'the config file\'s `[prices."MODEL"]` tables: `input_per_million = 0.15`, '
            "`output_per_million = 0.60` (per million prompt and generated tokens, in one "
            "currency); usage records then carry `cost`, and tenants may set `budget_cost`; "
            "see docs/tenants-and-quotas.md"
        },
    )
    # the engine settings handed to each local worker on its command line (the config file's
    # `[worker]` table, the engine flags, their variables); only those given, else the worker's
    # own defaults apply
    worker: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "the config file's `[worker]` table: the local workers' engine settings"},
    )
    api_key: list[str] = field(default_factory=list)
    tenants: str | None = None
    tenants_store: str = "file"  # file | redis: where the admin API keeps tenants (docs/admin.md)
    admin_key: list[str] = field(default_factory=list)  # bearer keys of the admin API (/admin)
    redis_url: str | None = None
    redis_prefix: str = "sluice:"
    redis_max_connections: int = setting(256, "most connections this process keeps open to Redis")
    redis_timeout: float = 2.0  # seconds a Redis command may take before Redis counts as away
    redis_outage_grace: float = 30.0  # live runs ride out a Redis outage this long
    disconnect_grace: float = 10.0
    # deadlines in seconds, 0 = none; each one that fires is its own terminal cause
    queue_timeout: float = 120.0
    ttft_timeout: float = 0.0
    inter_token_timeout: float = 60.0
    total_timeout: float = 1800.0  # the name tenants use too
    slow_client_timeout: float = 30.0  # a stream unwritable this long is detached
    cancel_confirm_timeout: float = setting(
        5.0, "seconds a cancelled run waits for its backend to confirm the stop"
    )
    run_retention: float = 600.0  # seconds an ended run can still be retrieved and resumed
    run_max_events: int = setting(4096, "events kept per run for resume")
    run_max_event_bytes: int = setting(
        8 << 20, "bytes of events kept per run for resume, at most (default 8 MiB)"
    )
    run_retention_bytes: int = 256 << 20  # ended runs kept in memory together (and, apart,
    # the endings kept with idempotency keys) hold at most this
    lease_ttl: float = setting(
        10.0, "with Redis: seconds a replica may stay silent before its runs are failed"
    )
    idempotency_ttl: float = 86400.0  # seconds an Idempotency-Key keeps its run
    usage_file: str | None = None  # the JSONL usage ledger without Redis (default: state dir)
    default_max_tokens: int = setting(
        1024, "tokens reserved against a tenant's tpm quota when a request names no max_tokens"
    )
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout: float = 30.0  # a request head or body slower than this is answered 408
    max_pending_connections: int = 1024  # connections without a whole request (head and body)
    keepalive_timeout: float = setting(75.0, "seconds an idle keep-alive connection stays open")
    ping_interval: float = 15.0
    stall_timeout: float = 10.0  # a pool member with work and no engine step this long is hung
    shutdown_timeout: float = 30.0  # on SIGTERM, live runs get this long to finish
    pool_routing: str = "affinity"  # affinity | least_load | random (adapters/pool_routing.py)
    retry_budget: float = 0.2  # retries: at most this share of requests over 10 s (design §6)
    # fair: saturated backends' runs wait in fair queues here, and local workers schedule by
    # tier and tenant; fcfs: runs go as they come (design §12)
    scheduling: str = "fair"
    worker_start_timeout: float = setting(
        300.0, "seconds a local worker may take to load its model and answer /health"
    )
    follow_token_ttl: float = 3600.0  # seconds a run's follow token lets a browser read it
    follow_token_secret: str | None = setting(
        None,
        "the key follow tokens are signed with, the same on every replica (no flag: keep it out "
        "of process lists); unset: with Redis, a random key the replicas share there, else one "
        "per process",
    )
    cors_origin: list[str] = field(default_factory=list)  # browser origins allowed (or "*")
    otlp_endpoint: str | None = None  # traces (docs/tracing.md): off unless set
    trace_sample_ratio: float = 1.0
    log_level: str = "info"
    event_loop: str = setting(
        "uvloop",
        "the event loop the gateway runs on: uvloop (C; about 5% less CPU a relayed stream) or "
        "asyncio (the standard library's)",
    )

    def __post_init__(self) -> None:
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name} must be one of {', '.join(allowed)}, not {getattr(self, name)!r}"
                )
        if self.tenants_store == "redis" and not self.redis_url:
            raise ValueError("tenants_store redis needs redis_url (--redis-url)")
        if not 0 <= self.retry_budget <= 1:
            raise ValueError(f"retry_budget must be between 0 and 1, not {self.retry_budget!r}")
        if not 0 <= self.trace_sample_ratio <= 1:
            raise ValueError(
                f"trace_sample_ratio must be between 0 and 1, not {self.trace_sample_ratio!r}"
            )
        check_otlp_endpoint(self.otlp_endpoint)
        check_keys(self.worker, ENGINE_KEYS, "[worker]")
        WorkerConfig(**self.worker)  # raises ValueError on a value the worker would refuse
        self.upstream_specs()  # raises ValueError on a malformed upstream
        self.aliases()  # raises ConfigError on a malformed alias (its targets: at start)
        self.price_table()  # raises ConfigError on a malformed price

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

    def aliases(self) -> list[Alias]:
        """The config file's `[models."ALIAS"]` tables (adapters/fallback_route.py); whether
        their targets are served is checked once the backends are up
        (gateway/backends/aliases.py)."""
        return parse_aliases(self.models)

    def price_table(self) -> dict[str, Price]:
        """The config file's `[prices."MODEL"]` tables (gateway/prices.py), by model."""
        return parse_prices(self.prices)

    def upstream_specs(self) -> list[UpstreamSpec]:
        """`--upstream NAME=BASE_URL[#capacity=N]`, then the config file's `[upstreams.NAME]`
        tables, validated."""
        specs = [_upstream_flag(spec) for spec in self.upstream]
        for name, table in self.upstreams.items():
            if not isinstance(table, dict):
                raise ValueError(f"[upstreams.{name}] must be a table with url and capacity")
            try:
                check_keys(table, ("url", "capacity"), f"[upstreams.{name}]")
            except ConfigError as e:
                raise ConfigError(f"{e}; it takes url and capacity only") from None
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


def load_settings(flags: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Settings:
    """`sluice serve`'s settings from its flags (None or [] = not given), `SLUICE_*` variables
    and the `--config` file; ConfigError names what cannot be used."""
    environ = os.environ if environ is None else environ
    table, where = config_file(flags, environ)
    values = resolve(describe(Settings), flags, environ, table, where)
    values["worker"] = worker_table(flags, environ, table.get("worker", {}), where)
    return build(Settings, values)


def worker_table(
    flags: Mapping[str, Any], environ: Mapping[str, str], table: Any, where: str
) -> dict[str, Any]:
    """The engine settings for the local workers: `serve`'s engine flags, then the worker's own
    variables (`SLUICE_MAX_NUM_SEQS`, …), then the file's `[worker]` table. Only those given."""
    where = f"{where} [worker]"
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: must be a table, not {table!r}")
    for key in table:
        if (why := _SET_BY_SERVE.get(key.replace("-", "_"))) is not None:
            raise ConfigError(f"{where}: {key!r} cannot be set here ({why})")
    engine = [s for s in worker_settings() if s.key in ENGINE_KEYS]
    values = resolve(engine, flags, environ, table, where)
    check_kv_sizing(values, where)
    build(WorkerConfig, values)  # the values a worker would refuse, refused here already
    return values
