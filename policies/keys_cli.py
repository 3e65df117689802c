"""`sluice keys create | list | revoke`: manage API keys in the tenants file (design §5, §9).

A new key goes to stdout alone, so `KEY=$(sluice keys create --tenant acme)` captures exactly it;
everything meant for the operator's eyes goes to stderr. Nothing here ever prints a stored hash.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from policies.tenants import TenantsFileError
from policies.tenants_file import create_key, list_keys, revoke_key

DEFAULT_TENANTS_FILE = "tenants.toml"


def _add_tenants_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tenants",
        default=os.environ.get("SLUICE_TENANTS") or DEFAULT_TENANTS_FILE,
        help="tenants TOML file (default: $SLUICE_TENANTS, else ./tenants.toml)",
    )


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    create = sub.add_parser("create", help="make a key for a tenant and print it once")
    create.add_argument("--tenant", required=True, help="tenant name (created if absent)")
    _add_tenants_flag(create)
    _add_tenants_flag(sub.add_parser("list", help="list keys by id (never the keys themselves)"))
    revoke = sub.add_parser("revoke", help="remove a key by its id")
    revoke.add_argument("key_id", help="a key id as shown by `list`, e.g. key_1a2b3c4d5e6f")
    _add_tenants_flag(revoke)
    return parser


# what a change is reported with: (action, key id, tenant, tenants file); the audit log's writer
OnChange = Callable[[str, str, str, str], None]


def main(argv: list[str], prog: str = "sluice keys", on_change: OnChange | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    report = on_change or (lambda *change: None)
    try:
        if args.action == "create":
            key, entry = create_key(args.tenants, args.tenant)
            print(key, flush=True)
            print(
                f"key id {entry.id} for tenant {args.tenant!r} recorded (as a hash) in "
                f"{args.tenants}; the key is not shown again",
                file=sys.stderr,
            )
            report("key.create", entry.id, args.tenant, args.tenants)
        elif args.action == "list":
            _print_table(list_keys(args.tenants))
        elif (tenant := revoke_key(args.tenants, args.key_id)) is None:
            print(f"{prog}: no key with id {args.key_id} in {args.tenants}", file=sys.stderr)
            return 1
        else:
            print(f"revoked {args.key_id} in {args.tenants}", file=sys.stderr)
            report("key.revoke", args.key_id, tenant, args.tenants)
    except TenantsFileError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    return 0


def _print_table(rows: list[tuple[str, str, str | None]]) -> None:
    lines = [("ID", "TENANT", "CREATED"), *((kid, t, created or "-") for kid, t, created in rows)]
    widths = [max(len(line[i]) for line in lines) for i in range(2)]
    for kid, tenant, created in lines:
        print(f"{kid:<{widths[0]}}  {tenant:<{widths[1]}}  {created}")
