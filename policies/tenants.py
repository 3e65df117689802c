"""Tenants and their limits, read from the tenants TOML file (design §5).

Loading is strict on purpose: a misspelt limit that silently meant "unlimited", or a key hash that
never matches, is worse than a gateway that refuses to start. Edits to the file (`sluice keys`,
the admin API) are tenants_file.py's.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass, field
from datetime import date, datetime
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from policies.auth import hash_key, key_id
from policies.tenants_fields import Section, TenantsFileError
from policies.tenants_safety import parse_policy
from policies.tenants_sharing import SHARING_FIELDS, Sharing, parse_sharing
from safety.policy import SafetyPolicy

ALGORITHMS = ("HS256", "RS256", "ES256")
DEADLINE_FIELDS = ("queue_timeout", "ttft_timeout", "inter_token_timeout", "total_timeout")
_LIMIT_FIELDS = ("rpm", "tpm", "max_concurrent", "max_tokens", "budget_tokens")
_TENANT_FIELDS = (
    *_LIMIT_FIELDS,
    "budget_period",
    "budget_cost",
    "models",
    *DEADLINE_FIELDS,
    "safety",
    "share_prefix_cache",
    *SHARING_FIELDS,
    "keys",
    "trace_content",
)
_JWT_FIELDS = (
    "algorithms",
    "issuer",
    "audience",
    "jwks_file",
    "public_key_file",
    "hs256_secret_env",
    "tenant_claim",
    "leeway",
)
_KEY_SOURCES = ("jwks_file", "public_key_file", "hs256_secret_env")
_PREFIX_CACHE_FIELDS = ("shared_system_prompts",)
_HASH = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(slots=True, frozen=True)
class TenantLimits:
    """Per-tenant limits; None means unlimited."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    max_tokens: int | None = None
    budget_tokens: int | None = None
    budget_period: float | None = None  # seconds
    budget_cost: float | None = None  # money per budget period, at the config's [prices]


@dataclass(slots=True, frozen=True)
class KeyEntry:
    """One API key as stored: its hash and when it was made, never the key."""

    hash: str  # "sha256:<hex>"
    created: str | None = None  # ISO-8601 UTC

    @property
    def id(self) -> str:
        return key_id(self.hash)


@dataclass(slots=True, frozen=True)
class Tenant:
    name: str
    limits: TenantLimits = TenantLimits()
    models: tuple[str, ...] = ("*",)  # fnmatch globs
    deadlines: dict[str, float] = field(default_factory=dict)  # any of DEADLINE_FIELDS
    keys: tuple[KeyEntry, ...] = ()
    safety: SafetyPolicy | None = None  # its [safety.NAME] policy; None: text is not checked
    share_prefix_cache: bool = False  # its prompts may reuse (and be reused by) others' cache
    sharing: Sharing = field(default_factory=Sharing)  # weight, tiers, queue bound (design §12)
    trace_content: bool = False  # its runs' traces may record prompt and completion text

    @property
    def digest(self) -> str:
        """The tenant as workers know it: a digest of its name, never the name."""
        return hashlib.sha256(f"tenant:{self.name}".encode()).hexdigest()[:32]

    @property
    def cache_salt(self) -> str | None:
        """What keeps this tenant's cached prompt blocks its own (None: shared with all who
        share): its digest."""
        return None if self.share_prefix_cache else self.digest

    def allows_model(self, model: str) -> bool:
        # NOTE: fnmatchcase, not fnmatch: model names are case-sensitive on every platform.
        return any(fnmatchcase(model, pattern) for pattern in self.models)


@dataclass(slots=True, frozen=True)
class JWTSettings:
    """The `[jwt]` table. Algorithms are pinned here; a token's header never chooses one."""

    algorithms: tuple[str, ...]
    issuer: str | None = None
    audience: str | None = None
    jwks_file: str | None = None  # resolved relative to the tenants file's folder
    public_key_file: str | None = None  # PEM, resolved the same way
    hs256_secret_env: str | None = None  # name of the env var holding the HS256 secret
    tenant_claim: str = "tenant"
    leeway: float = 30.0


@dataclass(slots=True, frozen=True)
class TenantsConfig:
    tenants: dict[str, Tenant]
    jwt: JWTSettings | None = None
    path: str | None = None
    # `[prefix_cache] shared_system_prompts`: a request whose first message is a system (or
    # developer) message with exactly one of these texts shares that message's cached blocks
    # with every tenant; what follows it stays the tenant's own (design §5)
    shared_system_prompts: frozenset[str] = frozenset()


def load_tenants(path: str | Path) -> TenantsConfig:
    """Read and validate the tenants file; any problem is a TenantsFileError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TenantsFileError(f"{path}: no such file", path=str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TenantsFileError(f"{path}: cannot read it: {exc}", path=str(path)) from None
    return parse_text(text, path)


def single_tenant(api_keys: list[str], name: str = "default") -> TenantsConfig:
    """The `--api-key` shortcut: one tenant, no limits, only the keys' hashes kept."""
    hashes = dict.fromkeys(hash_key(key) for key in api_keys)  # ordered, duplicates dropped
    tenant = Tenant(name, keys=tuple(KeyEntry(h) for h in hashes))
    return TenantsConfig(tenants={name: tenant})


def parse_text(text: str, path: Path) -> TenantsConfig:
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TenantsFileError(f"{path}: not valid TOML: {exc}", path=str(path)) from None
    return _parse(raw, path)


def _parse(raw: dict[str, Any], path: Path) -> TenantsConfig:
    top = Section(path, "top level")
    top.reject_unknown(raw, ("tenants", "safety", "jwt", "prefix_cache"))
    policies = {
        name: parse_policy(name, table, path)
        for name, table in _tables(raw, "safety", path).items()
    }
    tenants = {
        name: _tenant(name, table, path, policies)
        for name, table in _tables(raw, "tenants", path).items()
    }
    _check_unique_keys(tenants, path)
    jwt = _jwt(raw["jwt"], path) if "jwt" in raw else None
    shared = _shared_system_prompts(raw.get("prefix_cache", {}), path)
    return TenantsConfig(tenants=tenants, jwt=jwt, path=str(path), shared_system_prompts=shared)


def _tables(raw: dict[str, Any], name: str, path: Path) -> dict[str, dict]:
    """`[name.X]` tables as a dict; each X must itself be a table."""
    value = raw.get(name, {})
    if not isinstance(value, dict):
        Section(path, "top level").fail(name, f"expected [{name}.NAME] tables")
    for key, table in value.items():
        if not isinstance(table, dict):
            Section(path, "top level").fail(f"{name}.{key}", "expected a table")
    return value


def _tenant(
    name: str, table: dict[str, Any], path: Path, policies: dict[str, SafetyPolicy]
) -> Tenant:
    where = Section(path, f"tenant {name!r}", tenant=name)
    where.reject_unknown(table, _TENANT_FIELDS)
    safety = where.text(table, "safety")
    if safety is not None and safety not in policies:
        known = ", ".join(sorted(policies)) or "none are defined"
        where.fail("safety", f"no [safety.{safety}] policy (defined: {known})")
    limits = {f: where.positive_int(table, f) for f in _LIMIT_FIELDS}
    period = where.seconds(table, "budget_period", allow_zero=False)
    cost = where.amount(table, "budget_cost")
    if (period is None) != (limits["budget_tokens"] is None and cost is None):
        missing = "budget_tokens" if period is not None else "budget_period"
        where.fail(missing, "budget_period and a budget (tokens, cost) go together")
    deadlines = {f: where.seconds(table, f, allow_zero=True) for f in DEADLINE_FIELDS}
    models = where.strings(table, "models")
    return Tenant(
        name=name,
        limits=TenantLimits(**limits, budget_period=period, budget_cost=cost),
        models=("*",) if models is None else models,
        deadlines={f: s for f, s in deadlines.items() if s is not None},
        keys=_keys(table.get("keys", []), where),
        safety=None if safety is None else policies[safety],
        share_prefix_cache=_flag(table, "share_prefix_cache", where),
        sharing=parse_sharing(table, where),
        trace_content=_flag(table, "trace_content", where),
    )


def _flag(table: dict[str, Any], name: str, where: Section) -> bool:
    value = table.get(name, False)
    if not isinstance(value, bool):
        where.fail(name, f"expected true or false, got {value!r}")
    return value


def _keys(value: object, where: Section) -> tuple[KeyEntry, ...]:
    if not isinstance(value, list):
        where.fail("keys", "expected a list of key hashes")
    entries = []
    for i, item in enumerate(value):
        name = f"keys[{i}]"
        if isinstance(item, dict):
            for unknown in sorted(set(item) - {"hash", "created"}):
                where.fail(f"{name}.{unknown}", "unknown field (known: hash, created)")
            digest, created = item.get("hash"), item.get("created")
        else:
            digest, created = item, None
        # NOTE: the bad value is never echoed: it may be a plaintext key pasted by mistake.
        if not isinstance(digest, str) or not _HASH.fullmatch(digest):
            where.fail(name, 'expected "sha256:" and 64 lowercase hex digits (a key hash)')
        if isinstance(created, datetime | date):
            created = created.isoformat()
        elif created is not None and not isinstance(created, str):
            where.fail(f"{name}.created", f"expected an ISO-8601 time, got {created!r}")
        entries.append(KeyEntry(digest, created))
    return tuple(entries)


def _check_unique_keys(tenants: dict[str, Tenant], path: Path) -> None:
    """A hash listed twice would make a key's tenant depend on the order of the file."""
    owner: dict[str, str] = {}
    for tenant in tenants.values():
        for entry in tenant.keys:
            if entry.hash in owner:
                where = Section(path, f"tenant {tenant.name!r}", tenant=tenant.name)
                first = owner[entry.hash]
                where.fail("keys", f"key {entry.id} is also listed under tenant {first!r}")
            owner[entry.hash] = tenant.name


def _jwt(table: object, path: Path) -> JWTSettings:
    where = Section(path, "[jwt]")
    if not isinstance(table, dict):
        where.fail("jwt", "expected a table")
    where.reject_unknown(table, _JWT_FIELDS)
    algorithms = where.strings(table, "algorithms")
    if not algorithms:
        where.fail("algorithms", f"required: a non-empty list of {', '.join(ALGORITHMS)}")
    for alg in algorithms:
        if alg not in ALGORITHMS:
            where.fail("algorithms", f"{alg!r} is not accepted; use {', '.join(ALGORITHMS)}")
    sources = [name for name in _KEY_SOURCES if table.get(name) is not None]
    if len(sources) != 1:
        where.fail(sources[1] if sources else "jwks_file", f"set exactly one of {_KEY_SOURCES}")
    symmetric = "HS256" in algorithms
    if symmetric and (sources != ["hs256_secret_env"] or len(set(algorithms)) > 1):
        where.fail("algorithms", "HS256 needs hs256_secret_env and cannot mix with RS256/ES256")
    if not symmetric and sources == ["hs256_secret_env"]:
        where.fail("hs256_secret_env", "is for HS256; RS256/ES256 need a PEM or JWKS file")
    leeway = where.seconds(table, "leeway", allow_zero=True)
    return JWTSettings(
        algorithms=tuple(dict.fromkeys(algorithms)),
        issuer=where.text(table, "issuer"),
        audience=where.text(table, "audience"),
        jwks_file=_beside(path, where.text(table, "jwks_file")),
        public_key_file=_beside(path, where.text(table, "public_key_file")),
        hs256_secret_env=where.text(table, "hs256_secret_env"),
        tenant_claim=where.text(table, "tenant_claim") or "tenant",
        leeway=30.0 if leeway is None else leeway,
    )


def _shared_system_prompts(table: object, path: Path) -> frozenset[str]:
    """The `[prefix_cache]` table: the system prompts all tenants may share in the cache."""
    where = Section(path, "[prefix_cache]")
    if not isinstance(table, dict):
        where.fail("prefix_cache", "expected a table")
    where.reject_unknown(table, _PREFIX_CACHE_FIELDS)
    return frozenset(where.strings(table, "shared_system_prompts") or ())


def _beside(path: Path, name: str | None) -> str | None:
    """A file named in the tenants file is relative to that file's folder, not to the cwd."""
    return None if name is None else str(path.parent / name)
