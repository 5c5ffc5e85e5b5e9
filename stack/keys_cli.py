"""`llmq keys create | list | revoke`: API keys from the command line, on the database of DATABASE_URL
(llmq.settings), as the web process and the workers use it. Torch-free.

    llmq keys create --tenant acme [--name ci] [--rpm N --tpm N --max-upload-bytes N --max-batch-lines N --max-tokens N]
    llmq keys list [--json]          every key, never a secret
    llmq keys revoke KEY_ID

`create` prints the secret alone on stdout (so `KEY=$(llmq keys create --tenant acme)` works) and
what was made on stderr. The secret is shown only then: only its SHA-256 is stored.
"""
from __future__ import annotations

import json
import sys
import time

from sqlalchemy.exc import OperationalError, ProgrammingError

from llmq.settings import Settings
from llmq.store.api_keys import KeyLimits, create_key, list_keys, revoke_key
from llmq.store.database import Database
from llmq.store.models import ApiKey

# (command-line option, ApiKey column) for each per-key limit
LIMIT_OPTIONS = (("--rpm", "rate_limit_rpm", "requests per minute (0 = unlimited)"),
                 ("--tpm", "rate_limit_tpm", "tokens per minute, prompt + max_tokens x choices (0 = unlimited)"),
                 ("--max-upload-bytes", "max_upload_bytes", "largest upload in bytes"),
                 ("--max-batch-lines", "max_batch_lines", "most request lines in a batch file"),
                 ("--max-tokens", "max_tokens", "largest max_tokens a request may ask for (0 = no limit)"),
                 ("--max-request-choices", "max_request_choices", "most choices (prompts x n) in one request "
                                                                  "(0 = unlimited)"),
                 ("--max-request-tokens", "max_request_tokens", "most tokens one request may use, prompt + "
                                                                "max_tokens x choices (0 = unlimited)"))


def add_keys_command(commands) -> None:
    """Add `keys` and its subcommands to the `llmq` parser's subcommands."""
    keys = commands.add_parser("keys", help="create, list and revoke API keys").add_subparsers(
        dest="keys_command", required=True)

    create = keys.add_parser("create", help="make a key for a tenant and print its secret (shown only once)")
    create.add_argument("--tenant", required=True, help="who the key belongs to: it sees only its tenant's data")
    create.add_argument("--name", default="", help="a note to tell keys apart, e.g. 'ci' or 'alice'")
    for option, column, meaning in LIMIT_OPTIONS:
        create.add_argument(option, dest=column, type=int,
                            help=f"{meaning}; default: the server's setting (see README)")
    create.set_defaults(func=cmd_create)

    listing = keys.add_parser("list", help="every key: id, tenant, name, prefix, status, limits (never secrets)")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    listing.set_defaults(func=cmd_list)

    revoke = keys.add_parser("revoke", help="revoke a key: it is refused from the next request on")
    revoke.add_argument("key_id", help="the key's id (key_...), as `llmq keys list` shows it")
    revoke.set_defaults(func=cmd_revoke)


def cmd_create(args) -> int:
    limits = KeyLimits(**{column: getattr(args, column) for _, column, _ in LIMIT_OPTIONS})
    with _database() as database, database.session() as session:
        key, secret = create_key(session, args.tenant, args.name, limits)
        description = describe(key)
    print(secret)
    print(f"created {description['id']} for tenant {description['tenant']!r}. The secret above is shown only "
          "now; store it. Send it as 'Authorization: Bearer <secret>'.", file=sys.stderr)
    return 0


def cmd_list(args) -> int:
    with _database() as database, database.session() as session:
        keys = [describe(key) for key in list_keys(session)]
    if args.json:
        for key in keys:
            print(json.dumps(key))
        return 0
    if not keys:
        print("no API keys: the server is open (every call runs as tenant 'default')", file=sys.stderr)
        return 0
    columns = ("id", "tenant", "name", "prefix", "status", "created", "limits")
    rows = [[key["id"], key["tenant"], key["name"], key["prefix"] + "...",
             "revoked " + _time(key["revoked_at"]) if key["revoked_at"] else "active", _time(key["created_at"]),
             " ".join(f"{name}={value}" for name, value in key["limits"].items()) or "server defaults"]
            for key in keys]
    widths = [max(len(str(cell)) for cell in column) for column in zip(columns, *rows)]
    for row in (columns, *rows):
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def cmd_revoke(args) -> int:
    with _database() as database, database.session() as session:
        key = revoke_key(session, args.key_id)
        if key is None:
            print(f"llmq: error: no API key has id {args.key_id!r} (see `llmq keys list`)", file=sys.stderr)
            return 1
        description = describe(key)
    print(f"revoked {description['id']} (tenant {description['tenant']!r}, {description['prefix']}...) at "
          f"{_time(description['revoked_at'])}")
    return 0


def describe(key: ApiKey) -> dict:
    """What may be shown about a key: everything but its hash (and the secret, which is not stored)."""
    return {"id": key.id, "tenant": key.tenant, "name": key.name, "prefix": key.display_prefix,
            "created_at": key.created_at, "revoked_at": key.revoked_at,
            "limits": {column: getattr(key, column) for _, column, _ in LIMIT_OPTIONS
                       if getattr(key, column) is not None}}


class _database:
    """The database of DATABASE_URL, with a clear message when it has not been migrated."""

    def __enter__(self) -> Database:
        self.database = Database(Settings.from_env().database_url)
        return self.database

    def __exit__(self, kind, error, traceback):
        self.database.engine.dispose()
        if isinstance(error, (OperationalError, ProgrammingError)):
            raise ValueError(f"the database {self.database.engine.url!r} has no API keys table (or cannot be "
                             f"read): migrate it first with `python -m alembic upgrade head` ({error.orig})") from error
        return False


def _time(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))
