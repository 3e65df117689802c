"""The tenants file's `[safety.NAME]` tables, read into safety policies (design §5).

Strict like the rest of the file: an unknown field, a regex that does not compile or matches
nothing but the empty text, an unknown detector, or `on_error` without a remote checker to err
is an error naming the file, the policy and the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from policies.tenants_fields import Section
from safety.moderation import ModerationSettings
from safety.policy import MODES, PolicyError, SafetyPolicy, compile_terms

_FIELDS = (
    "mode",
    "window_chars",
    "block_terms",
    "redact",
    "moderation_url",
    "moderation_model",
    "moderation_api_key_env",
    "moderation_timeout",
    "on_error",
)
_ON_ERROR = ("block", "allow")


def parse_policy(name: str, table: dict[str, Any], path: Path) -> SafetyPolicy:
    where = Section(path, f"[safety.{name}]")
    where.reject_unknown(table, _FIELDS)
    mode = where.text(table, "mode") or "chars"
    if mode not in MODES:
        where.fail("mode", f"expected one of {', '.join(MODES)}, got {mode!r}")
    window = table.get("window_chars", 32)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        where.fail("window_chars", f"expected an integer of at least 0, got {window!r}")
    terms = where.strings(table, "block_terms") or ()
    try:
        compile_terms(terms)
    except PolicyError as exc:
        where.fail("block_terms", str(exc))
    try:
        return SafetyPolicy.build(
            name,
            mode=mode,
            window_chars=window,
            block_terms=terms,
            redact=where.strings(table, "redact") or (),
            moderation=_moderation(table, where),
        )
    except PolicyError as exc:
        where.fail("redact", str(exc))


def _moderation(table: dict[str, Any], where: Section) -> ModerationSettings | None:
    url = where.text(table, "moderation_url")
    if url is None:
        for name in _FIELDS[5:]:  # the remote checker's settings
            if name in table:
                where.fail(name, "only means something with moderation_url; set it or remove this")
        return None
    if not url.startswith(("http://", "https://")):
        where.fail("moderation_url", f"expected an http(s) URL, got {url!r}")
    on_error = where.text(table, "on_error") or "block"
    if on_error not in _ON_ERROR:
        where.fail("on_error", f"expected block or allow, got {on_error!r}")
    timeout = where.seconds(table, "moderation_timeout", allow_zero=False)
    return ModerationSettings(
        url=url,
        timeout=2.0 if timeout is None else timeout,
        model=where.text(table, "moderation_model"),
        api_key_env=where.text(table, "moderation_api_key_env"),
        on_error=on_error,
    )
