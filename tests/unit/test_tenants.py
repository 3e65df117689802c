"""The tenants file: the design §5 shape, strict validation, and key edits that keep comments."""

from __future__ import annotations

from pathlib import Path

import pytest

from policies.auth import hash_key, key_id
from policies.tenants import (
    KeyEntry,
    Tenant,
    TenantLimits,
    TenantsFileError,
    load_tenants,
    single_tenant,
)
from policies.tenants_fields import parse_duration
from policies.tenants_file import create_key, list_keys, revoke_key
from policies.tenants_sharing import Sharing
from policies.tenants_watch import reload_now

HASH_A = hash_key("sk-sluice-a")
HASH_B = hash_key("sk-sluice-b")

DESIGN_EXAMPLE = f"""
[tenants.acme]
rpm = 600                  # requests per minute
tpm = 200000               # tokens per minute: prompt + requested max reserved, unused refunded
max_concurrent = 16        # live runs at once
max_tokens = 4096          # cap on max_tokens / max_completion_tokens
budget_tokens = 10000000   # tokens per budget period
budget_period = "30d"
models = ["*"]             # allowed model names (globs)
queue_timeout = 30         # seconds; also ttft_timeout, inter_token_timeout, total_timeout
keys = ["{HASH_A}"]      # hashes only; written by `sluice keys create`

[jwt]                      # optional
issuer = "https://issuer.example"
audience = "sluicegate"
algorithms = ["RS256"]     # pinned; the token's header never chooses
jwks_file = "jwks.json"    # or hs256_secret_env = "SLUICE_JWT_SECRET"
tenant_claim = "tenant"
"""


def write(tmp_path: Path, text: str, name: str = "tenants.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load_error(tmp_path: Path, text: str) -> TenantsFileError:
    path = write(tmp_path, text)
    with pytest.raises(TenantsFileError) as info:
        load_tenants(path)
    assert str(path) in str(info.value)
    return info.value


def test_the_design_example_loads(tmp_path):
    config = load_tenants(write(tmp_path, DESIGN_EXAMPLE))
    acme = config.tenants["acme"]
    assert acme.limits == TenantLimits(
        rpm=600,
        tpm=200000,
        max_concurrent=16,
        max_tokens=4096,
        budget_tokens=10_000_000,
        budget_period=30 * 86400.0,
    )
    assert acme.models == ("*",)
    assert acme.deadlines == {"queue_timeout": 30.0}
    assert acme.keys == (KeyEntry(HASH_A),)
    assert acme.keys[0].id == key_id(HASH_A)
    jwt = config.jwt
    assert jwt is not None
    assert (jwt.algorithms, jwt.issuer, jwt.audience) == (
        ("RS256",),
        "https://issuer.example",
        "sluicegate",
    )
    assert jwt.jwks_file == str(tmp_path / "jwks.json")  # beside the tenants file, not the cwd
    assert (jwt.tenant_claim, jwt.leeway) == ("tenant", 30.0)
    assert config.path == str(tmp_path / "tenants.toml")


def test_a_tenant_names_its_safety_policy_and_gets_it_compiled(tmp_path):
    text = (
        '[safety.strict]\nmode = "sentence"\nwindow_chars = 64\n'
        'block_terms = ["Project Nightingale", "/\\\\bcodename-\\\\d+/"]\n'
        'redact = ["email", "card"]\nmoderation_url = "http://127.0.0.1:9/v1/moderations"\n'
        'on_error = "allow"\n'
        '[tenants.acme]\nsafety = "strict"\n[tenants.free]\n'
    )
    config = load_tenants(write(tmp_path, text))
    policy = config.tenants["acme"].safety
    assert config.tenants["free"].safety is None
    assert (policy.name, policy.mode, policy.window_chars) == ("strict", "sentence", 64)
    assert policy.redact == ("email", "card")
    assert policy.block_pattern.search("our PROJECT nightingale plan")
    assert policy.block_pattern.search("see codename-42") and not policy.block_pattern.search(
        "xcodename-42"
    )
    assert policy.moderation.on_error == "allow" and policy.moderation.timeout == 2.0
    assert len(policy.digest) == 64 and policy.label == f"strict@{policy.digest[:12]}"
    # the digest is of the content: the same policy under a reload has the same digest
    assert load_tenants(write(tmp_path, text)).tenants["acme"].safety.digest == policy.digest


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ('mode = "words"', "mode", "expected one of chars, sentence"),
        ("window_chars = -1", "window_chars", "at least 0"),
        ('block_terms = ["/(unclosed/"]', "block_terms", "not a valid regex"),
        ('block_terms = ["/x*/"]', "block_terms", "matches the empty text"),
        ('redact = ["ssn"]', "redact", "unknown detector 'ssn'"),
        ('on_error = "allow"', "on_error", "only means something with moderation_url"),
        ('moderation_url = "ftp://x"', "moderation_url", "http(s) URL"),
        ('moderation_url = "http://x"\non_error = "maybe"', "on_error", "block or allow"),
        ("windows = 3", "windows", "did you mean 'window_chars'"),
    ],
)
def test_every_safety_policy_error_names_the_policy_and_the_field(tmp_path, body, field, words):
    error = load_error(tmp_path, f"[safety.strict]\n{body}\n")
    assert error.field == field
    assert "[safety.strict]" in str(error) and words in str(error)


def test_a_tenant_naming_an_undefined_policy_is_refused(tmp_path):
    error = load_error(tmp_path, '[safety.strict]\n[tenants.acme]\nsafety = "strct"\n')
    assert error.field == "safety" and "no [safety.strct] policy (defined: strict)" in str(error)


def test_a_tenant_with_nothing_set_is_unlimited_and_allows_every_model(tmp_path):
    tenant = load_tenants(write(tmp_path, "[tenants.free]\n")).tenants["free"]
    assert tenant == Tenant("free")
    assert tenant.limits == TenantLimits()
    assert tenant.allows_model("anything/at-all")


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ("rmp = 600", "rmp", "did you mean 'rpm'"),
        ("rpm = 0", "rpm", "positive integer"),
        ("tpm = -5", "tpm", "positive integer"),
        ('max_concurrent = "16"', "max_concurrent", "positive integer"),
        ("max_tokens = 1.5", "max_tokens", "positive integer"),
        ("rpm = true", "rpm", "positive integer"),
        ('budget_period = "30d"', "budget_tokens", "go together"),
        ("budget_tokens = 1000", "budget_period", "go together"),
        ('budget_tokens = 1000\nbudget_period = "30 days"', "budget_period", "duration"),
        ('budget_tokens = 1000\nbudget_period = "0s"', "budget_period", "positive"),
        ('models = "gpt-*"', "models", "list of non-empty strings"),
        ("models = [1]", "models", "list of non-empty strings"),
        ('safety = "strict"', "safety", "no [safety.strict] policy"),
        ("queue_timeout = -1", "queue_timeout", "at least 0"),
        ('ttft_timeout = "soon"', "ttft_timeout", "duration"),
        (f'keys = "{HASH_A}"', "keys", "list of key hashes"),
        ('keys = ["sha256:abc"]', "keys[0]", "64 lowercase hex"),
        (f'keys = [{{hash = "{HASH_A}", note = "x"}}]', "keys[0].note", "unknown field"),
        (f'keys = [{{hash = "{HASH_A}", created = 5}}]', "keys[0].created", "ISO-8601"),
        ("weight = 0", "weight", "between"),
        ('weight = "3"', "weight", "positive number"),
        ("weight = 5000", "weight", "between"),
        ('tiers = ["gold"]', "tiers", "not a service tier"),
        ('tiers = "flex"', "tiers", "list of non-empty strings"),
        ('tiers = ["flex"]', "default_tier", "not among its tiers"),
        ('default_tier = "priority"', "default_tier", "not among its tiers"),
        ("max_queued = 0", "max_queued", "positive integer"),
        ("wieght = 2", "wieght", "did you mean 'weight'"),
    ],
)
def test_every_tenant_error_names_the_file_the_tenant_and_the_field(tmp_path, body, field, words):
    error = load_error(tmp_path, f"[tenants.acme]\n{body}\n")
    assert "tenant 'acme'" in str(error)
    assert f"field {field!r}" in str(error)
    assert words in str(error)
    assert (error.tenant, error.field) == ("acme", field)


def test_a_plaintext_key_pasted_into_keys_is_refused_without_being_echoed(tmp_path):
    error = load_error(tmp_path, '[tenants.acme]\nkeys = ["sk-sluice-very-secret"]\n')
    assert error.field == "keys[0]"
    assert "very-secret" not in str(error)


def test_the_same_key_in_two_tenants_is_an_error(tmp_path):
    text = f'[tenants.a]\nkeys = ["{HASH_A}"]\n[tenants.b]\nkeys = ["{HASH_B}", "{HASH_A}"]\n'
    error = load_error(tmp_path, text)
    assert (error.tenant, error.field) == ("b", "keys")
    assert f"key {key_id(HASH_A)} is also listed under tenant 'a'" in str(error)


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ('jwks_file = "j.json"', "algorithms", "required"),
        ('algorithms = []\njwks_file = "j.json"', "algorithms", "required"),
        ('algorithms = ["none"]\njwks_file = "j.json"', "algorithms", "'none' is not accepted"),
        ('algorithms = ["HS512"]\nhs256_secret_env = "S"', "algorithms", "not accepted"),
        ('algorithms = ["RS256"]', "jwks_file", "exactly one"),
        (
            'algorithms = ["RS256"]\njwks_file = "j"\npublic_key_file = "k"',
            "public_key_file",
            "one",
        ),
        ('algorithms = ["HS256"]\njwks_file = "j.json"', "algorithms", "HS256 needs"),
        ('algorithms = ["HS256", "RS256"]\nhs256_secret_env = "S"', "algorithms", "cannot mix"),
        ('algorithms = ["RS256"]\nhs256_secret_env = "S"', "hs256_secret_env", "is for HS256"),
        ('algorithms = ["RS256"]\njwks_file = "j"\naudiance = "x"', "audiance", "audience"),
        ('algorithms = ["RS256"]\njwks_file = "j"\nleeway = -1', "leeway", "at least 0"),
    ],
)
def test_jwt_table_errors_name_the_field(tmp_path, body, field, words):
    error = load_error(tmp_path, f"[jwt]\n{body}\n")
    assert f"[jwt]: field {field!r}" in str(error)
    assert words in str(error)


def test_file_level_errors_name_the_file(tmp_path):
    assert "did you mean 'tenants'" in str(load_error(tmp_path, "[tenant.acme]\nrpm = 1\n"))
    assert "not valid TOML" in str(load_error(tmp_path, "[tenants.acme\n"))
    missing = tmp_path / "nowhere.toml"
    with pytest.raises(TenantsFileError, match=r"nowhere\.toml: no such file"):
        load_tenants(missing)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("30d", 2_592_000.0), ("12h", 43_200.0), ("90m", 5_400.0), ("45s", 45.0), ("2.5h", 9_000.0),
     ("600", 600.0), (60, 60.0), (1.5, 1.5)],
)  # fmt: skip
def test_durations(value, seconds):
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["30 days", "", "d", "-5s", "1w", True, float("inf"), [1]])
def test_not_durations(value):
    with pytest.raises(ValueError):
        parse_duration(value)


def test_budget_period_is_stored_in_seconds(tmp_path):
    text = '[tenants.a]\nbudget_tokens = 5\nbudget_period = "12h"\n'
    assert load_tenants(write(tmp_path, text)).tenants["a"].limits.budget_period == 43_200.0


def test_allows_model_matches_globs_case_sensitively():
    tenant = Tenant("t", models=("gpt-4*", "llama-?-8b"))
    assert tenant.allows_model("gpt-4o-mini")
    assert tenant.allows_model("llama-3-8b")
    assert not tenant.allows_model("llama-31-8b")
    assert not tenant.allows_model("GPT-4o")
    assert not tenant.allows_model("claude")
    assert not Tenant("nothing", models=()).allows_model("gpt-4o")


def test_single_tenant_keeps_only_hashes_and_drops_duplicates():
    config = single_tenant(["sk-one", "sk-two", "sk-one"])
    tenant = config.tenants["default"]
    assert tenant.keys == (KeyEntry(hash_key("sk-one")), KeyEntry(hash_key("sk-two")))
    assert tenant.limits == TenantLimits()
    assert config.jwt is None
    assert single_tenant([], name="solo").tenants["solo"].keys == ()


HAND_WRITTEN = f"""# Production tenants. Ask #platform before raising limits.
[tenants.acme]
rpm = 600  # agreed with acme in March
keys = [
    "{HASH_A}",  # the CI key
]
"""


def test_create_list_revoke_round_trip_keeps_comments_and_never_writes_a_key(tmp_path):
    path = write(tmp_path, HAND_WRITTEN)
    key, entry = create_key(path, "acme")
    other, other_entry = create_key(path, "beta")  # a tenant not yet in the file

    raw = path.read_bytes()
    assert key.startswith("sk-sluice-") and other.startswith("sk-sluice-")
    assert key.encode() not in raw and other.encode() not in raw
    assert entry.hash == hash_key(key) and entry.hash.encode() in raw
    assert b"# Production tenants. Ask #platform" in raw
    assert b"# agreed with acme in March" in raw and b"# the CI key" in raw
    assert entry.created and entry.created.endswith("Z")

    config = load_tenants(path)
    assert config.tenants["acme"].keys == (KeyEntry(HASH_A), entry)
    assert config.tenants["acme"].limits.rpm == 600
    assert config.tenants["beta"].keys == (other_entry,)
    assert list_keys(path) == [
        (key_id(HASH_A), "acme", None),
        (entry.id, "acme", entry.created),
        (other_entry.id, "beta", other_entry.created),
    ]

    assert revoke_key(path, entry.id)
    assert [row[0] for row in list_keys(path)] == [key_id(HASH_A), other_entry.id]
    raw = path.read_bytes()
    assert entry.hash.encode() not in raw
    assert b"# agreed with acme in March" in raw and b"# the CI key" in raw

    before = path.read_bytes()
    assert not revoke_key(path, "key_000000000000")
    assert path.read_bytes() == before


def test_create_key_makes_the_file_when_there_is_none(tmp_path):
    path = tmp_path / "new" / "tenants.toml"
    path.parent.mkdir()
    key, entry = create_key(path, "acme")
    assert load_tenants(path).tenants["acme"].keys == (entry,)
    assert key.encode() not in path.read_bytes()
    assert path.read_text().startswith("# sluicegate tenants")


def test_create_key_refuses_to_edit_a_broken_file(tmp_path):
    path = write(tmp_path, "[tenants.acme]\nrmp = 5\n")
    with pytest.raises(TenantsFileError, match="rmp"):
        create_key(path, "acme")
    assert path.read_text() == "[tenants.acme]\nrmp = 5\n"
    assert [p.name for p in tmp_path.iterdir()] == ["tenants.toml"]  # no temp file left behind


def test_key_entries_may_carry_a_toml_datetime(tmp_path):
    text = f'[tenants.a]\nkeys = [{{hash = "{HASH_A}", created = 2024-05-01T12:00:00Z}}]\n'
    entry = load_tenants(write(tmp_path, text)).tenants["a"].keys[0]
    assert entry.created == "2024-05-01T12:00:00+00:00"


def test_shared_system_prompts_are_read_from_the_prefix_cache_table(tmp_path):
    text = (
        '[prefix_cache]\nshared_system_prompts = ["You are Acme\'s assistant.", "Be brief."]\n'
        "[tenants.acme]\n"
    )
    config = load_tenants(write(tmp_path, text))
    assert config.shared_system_prompts == frozenset({"You are Acme's assistant.", "Be brief."})
    assert load_tenants(write(tmp_path, "[tenants.acme]\n")).shared_system_prompts == frozenset()


@pytest.mark.parametrize(
    ("text", "field", "words"),
    [
        ('[prefix_cache]\nshared_system_prompt = ["x"]\n', "shared_system_prompt", "did you mean"),
        ('[prefix_cache]\nshared_system_prompts = "x"\n', "shared_system_prompts", "list of"),
        ("[prefix_cache]\nshared_system_prompts = [1]\n", "shared_system_prompts", "list of"),
        ('[prefix_cache]\nshared_system_prompts = [""]\n', "shared_system_prompts", "non-empty"),
        ("prefix_cache = 5\n", "prefix_cache", "expected a table"),
    ],
)
def test_prefix_cache_errors_name_the_field(tmp_path, text, field, words):
    error = load_error(tmp_path, text)
    assert f"[prefix_cache]: field {field!r}" in str(error)
    assert words in str(error)
    assert error.field == field


def test_a_reload_picks_up_changed_shared_system_prompts(tmp_path):
    path = write(tmp_path, '[prefix_cache]\nshared_system_prompts = ["old"]\n[tenants.acme]\n')
    seen = []
    assert reload_now(path, seen.append)
    path.write_text('[prefix_cache]\nshared_system_prompts = ["new"]\n[tenants.acme]\n')
    assert reload_now(path, seen.append)
    assert [c.shared_system_prompts for c in seen] == [frozenset({"old"}), frozenset({"new"})]


def test_sharing_fields_are_read_and_default_to_an_even_share(tmp_path):
    text = (
        "[tenants.plain]\n"
        "[tenants.batch]\n"
        'weight = 3\ntiers = ["flex", "priority"]\ndefault_tier = "flex"\nmax_queued = 9\n'
    )
    tenants = load_tenants(write(tmp_path, text)).tenants
    assert tenants["plain"].sharing == Sharing(1.0, ("default", "flex"), "default", 256)
    assert tenants["batch"].sharing == Sharing(3.0, ("flex", "priority"), "flex", 9)
    assert tenants["batch"].digest == tenants["batch"].cache_salt  # one digest, never the name
    assert "batch" not in tenants["batch"].digest
