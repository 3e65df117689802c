"""Tenants files for the gateway benchmark: every limit on (far above what it asks), or one
tenant whose safety policy varies."""

from __future__ import annotations

import time
from pathlib import Path

API_KEY = "sk-sluice-bench"
JWT_SECRET = "sluice-bench-jwt-secret-of-at-least-32-bytes"
SAFETY_WINDOW_CHARS = 32
TOKEN_CHARS = 5  # the scripted upstream's "tokN " tokens, for N < 100 (the --chunks default)


def write_tenants_file(folder: Path) -> Path:
    """One tenant with every limit on, all far above what the benchmark asks for."""
    from policies.auth import hash_key

    path = folder / "tenants.toml"
    path.write_text(
        f"""[tenants.bench]
rpm = 100000000
tpm = 100000000000
max_concurrent = 100000
max_tokens = 4096
budget_tokens = 100000000000000
budget_period = "1d"
models = ["*"]
keys = ["{hash_key(API_KEY)}"]

[jwt]
algorithms = ["HS256"]
hs256_secret_env = "SLUICE_BENCH_JWT_SECRET"
tenant_claim = "tenant"
"""
    )
    return path


def jwt_token() -> str:
    import jwt

    claims = {"tenant": "bench", "sub": "bench-user", "exp": int(time.time()) + 86400}
    return jwt.encode(claims, JWT_SECRET, algorithm="HS256")


def write_safety_tenants_file(folder: Path, window: str) -> Path:
    """One tenant, no limits; `window`: "window-off", or the policy's mode with a block term
    and every built-in detector on."""
    from policies.auth import hash_key

    path = folder / f"tenants-{window}.toml"
    policy = ""
    if window != "window-off":
        policy = (
            f'[safety.bench]\nmode = "{window}"\nwindow_chars = {SAFETY_WINDOW_CHARS}\n'
            'block_terms = ["Project Nightingale", "/\\\\bcodename-\\\\d+\\\\b/"]\n'
            'redact = ["email", "phone", "card", "secret"]\n\n'
        )
    tenant = 'safety = "bench"\n' if policy else ""
    path.write_text(f'{policy}[tenants.bench]\n{tenant}keys = ["{hash_key(API_KEY)}"]\n')
    return path
