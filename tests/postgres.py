"""A PostgreSQL database of its own for a test: made on the machine's PostgreSQL (127.0.0.1:5432 unless
KVRELAY_TEST_POSTGRES_URL names another server) and dropped afterwards."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

SERVER_URL = os.environ.get("KVRELAY_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


@contextmanager
def fresh_database() -> Iterator[str]:
    """The URL of a new, empty database; dropped (with every connection to it) afterwards."""
    name = f"kvrelay_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(SERVER_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield SERVER_URL.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with psycopg.connect(SERVER_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
