"""`kvrelay keys add | list | revoke`: the codec's API keys file (docs/admission.md).

The file holds each key's SHA-256, never the key: `add` prints the new key once, on stdout alone (so
`KEY=$(kvrelay keys add --tenant acme)` captures it), and the rest goes to stderr. Every change replaces
the file atomically, and a running codec picks it up within about a second, without a restart.

The file is --file, else `auth.keys_file` from --config and the environment (KVRELAY_AUTH__KEYS_FILE).
Torch-free.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from services.codec.admission.auth import (
    TENANT_PATTERN,
    KeyRecord,
    key_digest,
    new_key,
    now_iso,
    read_keys_file,
    write_keys_file,
)
from services.common.config import load_config
from services.common.errors import ConfigError, KvrelayError


class UnknownKeyError(KvrelayError):
    """`keys revoke` named a key ID the file does not hold."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("keys", help="add, list and revoke API keys (hashed in auth.keys_file)")
    actions = parser.add_subparsers(dest="keys_command", required=True)

    add = actions.add_parser("add", help="make a key for a tenant; prints it once")
    _file_arguments(add)
    add.add_argument("--tenant", required=True, help="the tenant the key authenticates as")
    add.add_argument("--admin", action="store_true", help="the key may also read /status (operators)")
    add.add_argument(
        "--cache-retention-24h",
        action="store_true",
        help='the key may ask for prompt_cache_retention "24h" (prefixes kept a day in the shared KV tier)',
    )
    add.add_argument(
        "--priority-tier",
        action="store_true",
        help='the key may ask for the high priority class (service_tier "priority", x-kvrelay-priority)',
    )
    add.set_defaults(handler=add_key)

    show = actions.add_parser("list", help="the keys' IDs, tenants and creation times (no secrets)")
    _file_arguments(show)
    show.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    show.set_defaults(handler=list_keys)

    revoke = actions.add_parser("revoke", help="remove a key; a running codec refuses it within ~1 s")
    _file_arguments(revoke)
    revoke.add_argument("--key-id", required=True, help="the key's ID (`kvrelay keys list`)")
    revoke.set_defaults(handler=revoke_key)


def _file_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--file", default=None, help="the keys file (default: auth.keys_file)")
    parser.add_argument("--config", default=None, help="kvrelay YAML config, for auth.keys_file")


def keys_file(args: argparse.Namespace) -> Path:
    if args.file:
        return Path(args.file)
    configured = load_config(args.config).auth.keys_file
    if configured is None:
        raise ConfigError("no keys file: pass --file, or set auth.keys_file (KVRELAY_AUTH__KEYS_FILE)")
    return Path(configured)


def _records(path: Path, *, missing_ok: bool = False) -> list[KeyRecord]:
    if missing_ok and not path.exists():
        return []
    return read_keys_file(path)


def add_key(args: argparse.Namespace) -> int:
    path = keys_file(args)
    if not re.fullmatch(TENANT_PATTERN, args.tenant):
        raise ConfigError(
            f"tenant {args.tenant!r} is not a valid name: letters, digits and . _ @ -, at most 64, "
            "starting with a letter or digit"
        )
    records = _records(path, missing_ok=True)
    taken = {record.key_id for record in records}
    key_id, key = new_key()
    while key_id in taken:  # 48 random bits: practically never
        key_id, key = new_key()
    record = KeyRecord(
        key_id=key_id, tenant=args.tenant, sha256=key_digest(key), created=now_iso(), admin=args.admin,
        cache_retention_24h=args.cache_retention_24h, priority_tier=args.priority_tier,
    )  # fmt: skip
    write_keys_file(path, [*records, record])
    print(key)
    print(
        f"added key {key_id} for tenant {args.tenant} to {path}; the key is shown only this once",
        file=sys.stderr,
    )
    return 0


def list_keys(args: argparse.Namespace) -> int:
    records = _records(keys_file(args))
    if args.json:
        rows = [
            {"key_id": r.key_id, "tenant": r.tenant, "created": r.created, "admin": r.admin,
             "cache_retention_24h": r.cache_retention_24h, "priority_tier": r.priority_tier}
            for r in records
        ]  # fmt: skip
        print(json.dumps({"keys": rows}, indent=2))
        return 0
    widths = (max([6, *(len(r.key_id) for r in records)]), max([6, *(len(r.tenant) for r in records)]))
    print(f"{'KEY ID':<{widths[0]}}  {'TENANT':<{widths[1]}}  {'CREATED':<20}  ADMIN  RETAIN 24H  PRIORITY")
    for record in records:
        admin = "yes" if record.admin else ""
        retain = "yes" if record.cache_retention_24h else ""
        priority = "yes" if record.priority_tier else ""
        fields = (record.key_id.ljust(widths[0]), record.tenant.ljust(widths[1]), record.created.ljust(20))
        print("  ".join((*fields, admin.ljust(5), retain.ljust(10), priority)).rstrip())
    return 0


def revoke_key(args: argparse.Namespace) -> int:
    path = keys_file(args)
    records = _records(path)
    kept = [record for record in records if record.key_id != args.key_id]
    if len(kept) == len(records):
        raise UnknownKeyError(f"no key with ID {args.key_id} in {path}")
    write_keys_file(path, kept)
    print(f"revoked key {args.key_id} in {path}", file=sys.stderr)
    return 0
