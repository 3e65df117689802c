"""Editing the tenants file in place: keys made and revoked (`sluice keys`, the admin API).

Edits go through tomlkit so the operator's comments and ordering survive, only ever write key
hashes, and are checked to load (policies/tenants.py's parser) before the new text is swapped in
atomically.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import tomlkit
from tomlkit.items import Array

from policies.auth import generate_key, hash_key, key_id
from policies.tenants import KeyEntry, load_tenants, parse_text
from policies.tenants_fields import TenantsFileError

_NEW_FILE_HEADER = (
    "# sluicegate tenants (see design §5). `sluice keys create` records keys here as SHA-256\n"
    "# hashes only; a key itself is shown once, when it is created.\n"
)


def create_key(path: str | Path, tenant: str) -> tuple[str, KeyEntry]:
    """Make a key for `tenant` and record only its hash; the caller shows the key once."""
    path = Path(path)
    if not tenant:
        raise TenantsFileError(f"{path}: a tenant name is required", path=str(path))
    doc = read_document(path) if path.exists() else new_document()
    key, entry = add_key(doc, tenant)
    write_document(path, doc)
    return key, entry


def new_document() -> tomlkit.TOMLDocument:
    """An empty tenants document, with the header a new file starts with."""
    return tomlkit.parse(_NEW_FILE_HEADER)


def add_key(doc: tomlkit.TOMLDocument, tenant: str) -> tuple[str, KeyEntry]:
    """Make a key for `tenant` (added if absent) and record only its hash in `doc`."""
    key = generate_key()
    entry = KeyEntry(hash_key(key), datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    keys = _keys_array(doc, tenant)
    keys.multiline(True)  # one key per line keeps diffs and hand edits readable
    keys.append(tomlkit.inline_table().add("hash", entry.hash).add("created", entry.created))
    return key, entry


def list_keys(path: str | Path) -> list[tuple[str, str, str | None]]:
    """(key id, tenant, created) for every key in the file."""
    config = load_tenants(path)
    return [(e.id, t.name, e.created) for t in config.tenants.values() for e in t.keys]


def revoke_key(path: str | Path, key_id_: str) -> str | None:
    """Remove the key with this id; the tenant it belonged to, None when no key has it (the
    file is then untouched)."""
    path = Path(path)
    doc = read_document(path)
    tenant = remove_key(doc, key_id_, str(path))
    if tenant is not None:
        write_document(path, doc)
    return tenant


def remove_key(doc: tomlkit.TOMLDocument, key_id_: str, where: str) -> str | None:
    """Remove the key with this id from `doc`; the tenant it belonged to, None when no key has
    it (`doc` is then untouched)."""
    found: list[tuple[str, Array, int]] = []
    for name, table in doc.get("tenants", {}).items():
        keys = table.get("keys", [])
        for i, item in enumerate(keys):
            digest = item.get("hash") if isinstance(item, dict) else item
            if key_id(str(digest)) == key_id_:
                found.append((name, keys, i))
    if len(found) > 1:
        raise TenantsFileError(f"{where}: key id {key_id_} is ambiguous; edit the file by hand")
    if not found:
        return None
    name, keys, i = found[0]
    del keys[i]
    return name


def read_document(path: Path) -> tomlkit.TOMLDocument:
    """The file as tomlkit sees it, after checking it loads: never edit a broken file."""
    load_tenants(path)
    return tomlkit.parse(path.read_text(encoding="utf-8"))


def _keys_array(doc: tomlkit.TOMLDocument, tenant: str) -> Array:
    if "tenants" not in doc:
        doc["tenants"] = tomlkit.table(is_super_table=True)
    tenants = doc["tenants"]
    if tenant not in tenants:
        table = tomlkit.table()
        table["keys"] = tomlkit.array()
        table.add(tomlkit.nl())
        tenants[tenant] = table
    table = tenants[tenant]
    if "keys" not in table:
        table["keys"] = tomlkit.array()
    return table["keys"]


def write_document(path: Path, doc: tomlkit.TOMLDocument) -> None:
    """Check the new text loads, then swap it in atomically (a reader never sees half a file)."""
    text = tomlkit.dumps(doc)
    parse_text(text, path)
    target = Path(os.path.realpath(path))
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        if target.exists():
            shutil.copymode(target, tmp)
        else:
            os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
