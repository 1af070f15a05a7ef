"""The batch store: files, batches and their lines in PostgreSQL (docs/batches.md).

Why PostgreSQL, not the queue's Redis or a volume: input files reach hundreds of megabytes and results
as many, which a Redis holds in memory; every codec replica and drainer must read and write them, which
a volume does only where the cluster offers ReadWriteMany; and a batch ends in one step (every line
done, its output files written, its status final) that a transaction makes atomic. The queue's Redis
still carries the work: one job per line (services/codec/lane/batches.py), so the lines of a batch
spread over every drainer.

Tables (`batches.table_prefix`, default `kvrelay_`), made at first use:

- `files`: an uploaded file or a batch's output, its tenant, purpose, size, expiry and bytes;
- `batches`: a batch, its tenant, API (`openai`, `anthropic`), status and the API's own fields;
- `batch_lines`: one row per line (the primary key is the batch and the line's index): its custom_id,
  the request to run (none for a line already refused), its state (`pending`, `running`, `done`), and
  once done its outcome (`succeeded`, `errored`, `cancelled`, `expired`) and result. A line is done
  once: the first finisher writes it, a second (its drainer was presumed dead) changes nothing.

Every failure to reach PostgreSQL is BatchStoreUnavailableError (a 503 in the protocol's shape).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from services.codec.errors import INVALID_REQUEST, StoreUnavailableError, WireError
from services.common.errors import KvrelayError

OPEN = ("in_progress", "cancelling", "expiring")  # a batch still running or finishing its running lines
FINAL_OF = {"in_progress": "completed", "cancelling": "cancelled", "expiring": "expired"}


class BatchStoreUnavailableError(StoreUnavailableError):
    """PostgreSQL did not answer: files and batches cannot be read or written now (503)."""

    what = "files and batches are"


@dataclass(frozen=True)
class FileRow:
    file_id: str
    tenant: str
    purpose: str
    filename: str
    num_bytes: int
    created_at: int
    expires_at: int | None


@dataclass(frozen=True)
class BatchRow:
    batch_id: str
    tenant: str
    api: str
    key_id: str | None
    status: str
    created_at: int
    expires_at: int
    num_lines: int
    detail: dict[str, Any]  # the API's own fields: endpoint, files, metadata, timestamps


@dataclass(frozen=True)
class LineRow:
    idx: int
    custom_id: str | None
    request: dict[str, Any] | None  # {"url", "body"}; None: refused at creation
    outcome: str | None = None
    result: dict[str, Any] | None = None


@dataclass(frozen=True)
class NewFile:
    """A file to write: an upload or a batch's output."""

    file_id: str
    purpose: str
    filename: str
    content: bytes
    expires_at: int | None


# A finishing batch's files, made from the batch and its lines (in order) inside the finishing transaction.
RenderFiles = Callable[[BatchRow, list[LineRow]], tuple[list[NewFile], dict[str, Any]]]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS {p}files (
  id text PRIMARY KEY, tenant text NOT NULL, purpose text NOT NULL, filename text NOT NULL,
  bytes bigint NOT NULL, created_at bigint NOT NULL, expires_at bigint, content bytea NOT NULL);
CREATE INDEX IF NOT EXISTS {p}files_by_tenant ON {p}files (tenant, created_at, id);
CREATE INDEX IF NOT EXISTS {p}files_by_expiry ON {p}files (expires_at);
CREATE TABLE IF NOT EXISTS {p}batches (
  id text PRIMARY KEY, tenant text NOT NULL, api text NOT NULL, key_id text, status text NOT NULL,
  created_at bigint NOT NULL, expires_at bigint NOT NULL, ended_at bigint, num_lines int NOT NULL,
  detail jsonb NOT NULL);
CREATE INDEX IF NOT EXISTS {p}batches_by_tenant ON {p}batches (tenant, api, created_at, id);
CREATE INDEX IF NOT EXISTS {p}batches_by_end ON {p}batches (ended_at);
CREATE INDEX IF NOT EXISTS {p}batches_open ON {p}batches (status, expires_at)
  WHERE status IN ('in_progress', 'cancelling', 'expiring');
CREATE TABLE IF NOT EXISTS {p}batch_lines (
  batch_id text NOT NULL REFERENCES {p}batches (id) ON DELETE CASCADE, idx int NOT NULL,
  custom_id text, request jsonb, state text NOT NULL, outcome text, result jsonb,
  attempts int NOT NULL DEFAULT 0, PRIMARY KEY (batch_id, idx));
CREATE INDEX IF NOT EXISTS {p}batch_lines_undone ON {p}batch_lines (batch_id) WHERE state <> 'done';
"""


class BatchStore:
    """Files, batches and lines in the PostgreSQL at `url`, tables named with `prefix`."""

    def __init__(self, url: str, *, prefix: str = "kvrelay_", timeout_s: float = 5.0) -> None:
        self.prefix = prefix
        # Each connection checked as it is handed out, and kept alive with TCP keepalives: a server that
        # went away is found in seconds, not at the kernel's TCP timeout.
        alive = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3}
        self.pool = AsyncConnectionPool(
            url, min_size=1, max_size=8, open=False, timeout=timeout_s,
            kwargs={"connect_timeout": max(1, int(timeout_s)), **alive},
            check=AsyncConnectionPool.check_connection,
        )  # fmt: skip
        self._ready = False

    async def open(self) -> None:
        await self.pool.open(wait=False)

    async def aclose(self) -> None:
        await self.pool.close()

    # -- files -------------------------------------------------------------------------------------------

    async def add_file(self, tenant: str, new: NewFile, *, max_files: int) -> FileRow:
        """Keep `new` for `tenant` unless it already holds `max_files` files (FileCapError)."""
        row = FileRow(
            new.file_id, tenant, new.purpose, new.filename, len(new.content), int(time.time()), new.expires_at
        )
        async with self.transaction("keep a file") as cur:
            await cur.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"files:{tenant}",))
            await cur.execute(f"SELECT count(*) AS n FROM {self.prefix}files WHERE tenant = %s", (tenant,))
            held = int((await cur.fetchone() or {"n": 0})["n"])
            if held >= max_files:
                raise FileCapError(held, max_files)
            await self._insert_file(cur, row, new.content)
        return row

    async def file(self, tenant: str, file_id: str) -> FileRow | None:
        found = await self._live_file("read a file", _FILE_COLUMNS, tenant, file_id)
        return _file_row(found) if found else None

    async def content(self, tenant: str, file_id: str) -> bytes | None:
        found = await self._live_file("read a file's content", "content", tenant, file_id)
        return bytes(found["content"]) if found else None

    async def _live_file(self, what: str, columns: str, tenant: str, file_id: str) -> dict[str, Any] | None:
        """`columns` of `tenant`'s file `file_id` unless it expired."""
        async with self.transaction(what) as cur:
            await cur.execute(
                f"SELECT {columns} FROM {self.prefix}files WHERE id = %s AND tenant = %s AND "
                "(expires_at IS NULL OR expires_at > %s)",
                (file_id, tenant, int(time.time())),
            )
            found: dict[str, Any] | None = await cur.fetchone()
        return found

    async def files(
        self, tenant: str, *, purpose: str | None, after: str | None, limit: int, newest_first: bool
    ) -> list[FileRow]:
        """A page of `tenant`'s files, ordered by creation, after the file `after` (exclusive)."""
        order, op = ("DESC", "<") if newest_first else ("ASC", ">")
        where, args = ["tenant = %s", "(expires_at IS NULL OR expires_at > %s)"], [tenant, int(time.time())]
        if purpose is not None:
            where.append("purpose = %s")
            args.append(purpose)
        if after is not None:
            where.append(
                f"(created_at, id) {op} (SELECT created_at, id FROM {self.prefix}files WHERE id = %s "
                "AND tenant = %s)"
            )
            args += [after, tenant]
        async with self.transaction("list files") as cur:
            await cur.execute(
                f"SELECT {_FILE_COLUMNS} FROM {self.prefix}files WHERE {' AND '.join(where)} "
                f"ORDER BY created_at {order}, id {order} LIMIT %s",
                (*args, limit),
            )
            return [_file_row(found) for found in await cur.fetchall()]

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        async with self.transaction("delete a file") as cur:
            await cur.execute(
                f"DELETE FROM {self.prefix}files WHERE id = %s AND tenant = %s", (file_id, tenant)
            )
            return cur.rowcount > 0

    # -- batches -----------------------------------------------------------------------------------------

    async def add_batch(self, batch: BatchRow, lines: Sequence[LineRow]) -> None:
        """Keep a new batch and its lines; a line with no request is done (refused) from the start."""
        async with self.transaction("keep a batch") as cur:
            await cur.execute(
                f"INSERT INTO {self.prefix}batches (id, tenant, api, key_id, status, created_at, expires_at, "
                "num_lines, detail) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)",
                (
                    batch.batch_id, batch.tenant, batch.api, batch.key_id, batch.status, batch.created_at,
                    batch.expires_at, batch.num_lines, Jsonb(batch.detail),
                ),
            )  # fmt: skip
            async with cur.copy(
                f"COPY {self.prefix}batch_lines (batch_id, idx, custom_id, request, state, outcome, result) "
                "FROM STDIN"
            ) as copy:
                for line in lines:
                    await copy.write_row(
                        (
                            batch.batch_id, line.idx, line.custom_id, _json(line.request),
                            "pending" if line.request is not None else "done", line.outcome,
                            _json(line.result),
                        )
                    )  # fmt: skip

    async def drop_batch(self, batch_id: str) -> None:
        async with self.transaction("drop a batch") as cur:
            await cur.execute(f"DELETE FROM {self.prefix}batches WHERE id = %s", (batch_id,))

    async def batch(self, tenant: str | None, batch_id: str) -> BatchRow | None:
        """The batch `batch_id` (of `tenant`; any tenant's for None)."""
        async with self.transaction("read a batch") as cur:
            await cur.execute(
                f"SELECT {_BATCH_COLUMNS} FROM {self.prefix}batches WHERE id = %s AND "
                "(%s::text IS NULL OR tenant = %s)",
                (batch_id, tenant, tenant),
            )
            found = await cur.fetchone()
        return _batch_row(found) if found else None

    async def batches(
        self, tenant: str, api: str, *, after: str | None, before: str | None, limit: int
    ) -> list[BatchRow]:
        """A page of `tenant`'s batches of `api`, newest first: older than `after`, newer than `before`."""
        where, args = ["tenant = %s", "api = %s"], [tenant, api]
        for anchor, op in ((after, "<"), (before, ">")):
            if anchor is not None:
                where.append(
                    f"(created_at, id) {op} (SELECT created_at, id FROM {self.prefix}batches WHERE id = %s "
                    "AND tenant = %s AND api = %s)"
                )
                args += [anchor, tenant, api]
        order = "ASC" if before is not None and after is None else "DESC"
        async with self.transaction("list batches") as cur:
            await cur.execute(
                f"SELECT {_BATCH_COLUMNS} FROM {self.prefix}batches WHERE {' AND '.join(where)} "
                f"ORDER BY created_at {order}, id {order} LIMIT %s",
                (*args, limit),
            )
            rows = [_batch_row(found) for found in await cur.fetchall()]
        return rows if order == "DESC" else rows[::-1]

    async def counts(self, batch_id: str) -> dict[str, int]:
        """The batch's lines by outcome, and `pending` for those not done."""
        async with self.transaction("count a batch's lines") as cur:
            await cur.execute(
                f"SELECT coalesce(outcome, 'pending') AS outcome, count(*) AS n "
                f"FROM {self.prefix}batch_lines WHERE batch_id = %s GROUP BY 1",
                (batch_id,),
            )
            return {found["outcome"]: int(found["n"]) for found in await cur.fetchall()}

    async def lines(self, batch_id: str) -> list[LineRow]:
        async with self.transaction("read a batch's lines") as cur:
            await cur.execute(
                f"SELECT idx, custom_id, request, outcome, result FROM {self.prefix}batch_lines "
                "WHERE batch_id = %s ORDER BY idx",
                (batch_id,),
            )
            return [_line_row(found) for found in await cur.fetchall()]

    async def update_detail(self, batch_id: str, detail: dict[str, Any]) -> None:
        async with self.transaction("update a batch") as cur:
            await cur.execute(
                f"UPDATE {self.prefix}batches SET detail = detail || %s WHERE id = %s",
                (Jsonb(detail), batch_id),
            )

    async def delete_batch(self, tenant: str, batch_id: str) -> bool:
        """Forget an ended batch and its lines (Anthropic's DELETE); False when none or not ended."""
        async with self.transaction("delete a batch") as cur:
            await cur.execute(
                f"DELETE FROM {self.prefix}batches WHERE id = %s AND tenant = %s AND status <> ALL(%s)",
                (batch_id, tenant, list(OPEN)),
            )
            return cur.rowcount > 0

    # -- lines -------------------------------------------------------------------------------------------

    async def claim(self, batch_id: str, idx: int) -> tuple[str, LineRow | None, int]:
        """Start the line: (the batch's status, the line when it is to run, the times it was started). A
        line runs while its batch is in progress and the line is pending, or running (its last drainer died:
        the queue handed it over)."""
        async with self.transaction("start a batch line") as cur:
            await cur.execute(f"SELECT status FROM {self.prefix}batches WHERE id = %s", (batch_id,))
            found = await cur.fetchone()
            if found is None:
                return "gone", None, 0
            if found["status"] != "in_progress":
                return str(found["status"]), None, 0
            await cur.execute(
                f"UPDATE {self.prefix}batch_lines SET state = 'running', attempts = attempts + 1 "
                "WHERE batch_id = %s AND idx = %s AND state <> 'done' "
                "RETURNING idx, custom_id, request, outcome, result, attempts",
                (batch_id, idx),
            )
            line = await cur.fetchone()
        return "in_progress", _line_row(line) if line else None, int(line["attempts"]) if line else 0

    async def finish_line(self, batch_id: str, idx: int, outcome: str, result: dict[str, Any]) -> bool:
        """Write the line's outcome, once (False: it was already done)."""
        async with self.transaction("finish a batch line") as cur:
            await cur.execute(
                f"UPDATE {self.prefix}batch_lines SET state = 'done', outcome = %s, result = %s "
                "WHERE batch_id = %s AND idx = %s AND state <> 'done'",
                (outcome, Jsonb(storable(result)), batch_id, idx),
            )
            return cur.rowcount > 0

    async def close(self, batch_id: str, tenant: str | None, status: str, at_field: str) -> bool:
        """Move an in-progress batch to `status` (cancelling, expiring), stamping `at_field` in its
        detail; its pending lines end as cancelled or expired. False when it was not in progress."""
        outcome = {"cancelling": "cancelled", "expiring": "expired"}[status]
        now = int(time.time())
        async with self.transaction("close a batch") as cur:
            await cur.execute(
                f"UPDATE {self.prefix}batches SET status = %s, detail = detail || %s WHERE id = %s "
                "AND (%s::text IS NULL OR tenant = %s) AND status = 'in_progress'",
                (status, Jsonb({at_field: now}), batch_id, tenant, tenant),
            )
            if cur.rowcount == 0:
                return False
            await cur.execute(
                f"UPDATE {self.prefix}batch_lines SET state = 'done', outcome = %s WHERE batch_id = %s AND "
                "state = 'pending'",
                (outcome, batch_id),
            )
        return True

    async def end_line(self, batch_id: str, idx: int, batch_status: str) -> None:
        """A line of a closing batch whose job came back: it ends as its batch's pending lines did."""
        outcome = {"cancelling": "cancelled", "expiring": "expired"}.get(batch_status)
        if outcome is None:
            return
        async with self.transaction("end a batch line") as cur:
            await cur.execute(
                f"UPDATE {self.prefix}batch_lines SET state = 'done', outcome = %s WHERE batch_id = %s "
                "AND idx = %s AND state <> 'done'",
                (outcome, batch_id, idx),
            )

    async def finalize(self, batch_id: str, render: RenderFiles) -> BatchRow | None:
        """End the batch if every line is done: its files written (`render`) and its status final, in one
        transaction. The ended batch; None when it is not ready or another finisher ended it."""
        async with self.transaction("end a batch") as cur:
            await cur.execute(
                f"SELECT {_BATCH_COLUMNS} FROM {self.prefix}batches WHERE id = %s FOR UPDATE", (batch_id,)
            )
            found = await cur.fetchone()
            if found is None or found["status"] not in OPEN:
                return None
            await cur.execute(
                f"SELECT 1 FROM {self.prefix}batch_lines WHERE batch_id = %s AND state <> 'done' LIMIT 1",
                (batch_id,),
            )
            if await cur.fetchone() is not None:
                return None
            batch = _batch_row(found)
            await cur.execute(
                f"SELECT idx, custom_id, request, outcome, result FROM {self.prefix}batch_lines "
                "WHERE batch_id = %s ORDER BY idx",
                (batch_id,),
            )
            files, detail = render(batch, [_line_row(line) for line in await cur.fetchall()])
            now = int(time.time())
            for new in files:
                row = FileRow(
                    new.file_id,
                    batch.tenant,
                    new.purpose,
                    new.filename,
                    len(new.content),
                    now,
                    new.expires_at,
                )
                await self._insert_file(cur, row, new.content)
            final = FINAL_OF[batch.status]
            await cur.execute(
                f"UPDATE {self.prefix}batches SET status = %s, ended_at = %s, detail = detail || %s "
                "WHERE id = %s",
                (final, now, Jsonb(detail), batch_id),
            )
        return BatchRow(
            batch.batch_id, batch.tenant, batch.api, batch.key_id, final, batch.created_at,
            batch.expires_at, batch.num_lines, {**batch.detail, **detail},
        )  # fmt: skip

    # -- upkeep ------------------------------------------------------------------------------------------

    async def due(self, now: int) -> tuple[list[str], list[str]]:
        """(batches in progress past their expiry, batches to end if their lines are all done: the closing
        ones, and those in progress with no line left, whose last finisher died before ending them)."""
        async with self.transaction("find batches due") as cur:
            await cur.execute(
                f"SELECT b.id, b.status, b.expires_at, NOT EXISTS (SELECT 1 FROM {self.prefix}batch_lines l "
                "WHERE l.batch_id = b.id AND l.state <> 'done') AS all_done "
                f"FROM {self.prefix}batches b WHERE b.status = ANY(%s)",
                (list(OPEN),),
            )
            rows = await cur.fetchall()
        expired = [r["id"] for r in rows if r["status"] == "in_progress" and r["expires_at"] <= now]
        ending = [r["id"] for r in rows if r["status"] != "in_progress" or r["all_done"]]
        return expired, ending

    async def forget_before(self, now: int, batches_before: int) -> None:
        """Drop expired files, and batches (with their lines) that ended before `batches_before`."""
        async with self.transaction("drop expired files and batches") as cur:
            await cur.execute(f"DELETE FROM {self.prefix}files WHERE expires_at <= %s", (now,))
            await cur.execute(
                f"DELETE FROM {self.prefix}batches WHERE ended_at IS NOT NULL AND ended_at < %s",
                (batches_before,),
            )

    async def census(self) -> tuple[dict[str, int], float]:
        """Batches by status, and the age in seconds of the oldest unfinished one (0 when none)."""
        async with self.transaction("count batches") as cur:
            await cur.execute(
                f"SELECT status, count(*) AS n, min(created_at) AS oldest FROM {self.prefix}batches "
                "GROUP BY 1"
            )
            rows = await cur.fetchall()
        oldest = [r["oldest"] for r in rows if r["status"] in OPEN]
        return {r["status"]: int(r["n"]) for r in rows}, (time.time() - min(oldest)) if oldest else 0.0

    # -- inside ------------------------------------------------------------------------------------------

    async def _insert_file(self, cur: psycopg.AsyncCursor[Any], row: FileRow, content: bytes) -> None:
        await cur.execute(
            f"INSERT INTO {self.prefix}files (id, tenant, purpose, filename, bytes, created_at, expires_at, "
            "content) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
            (
                row.file_id, row.tenant, row.purpose, row.filename, row.num_bytes, row.created_at,
                row.expires_at, content,
            ),
        )  # fmt: skip

    @contextlib.asynccontextmanager
    async def transaction(self, what: str) -> AsyncIterator[psycopg.AsyncCursor[Any]]:
        """A cursor in one transaction; any failure to reach PostgreSQL is BatchStoreUnavailableError."""
        try:
            async with self.pool.connection() as conn:
                if not self._ready:  # one maker at a time: concurrent IF NOT EXISTS collide in pg_type
                    async with conn.transaction():
                        await conn.execute(
                            "SELECT pg_advisory_xact_lock(hashtext(%s))", (f"schema:{self.prefix}",)
                        )
                        await conn.execute(_SCHEMA.format(p=self.prefix))
                    self._ready = True
                async with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
                    yield cur
        except (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout) as exc:  # not DataError
            raise BatchStoreUnavailableError(
                f"the batch store failed to {what}: {type(exc).__name__}"
            ) from exc


class FileCapError(KvrelayError):
    """The tenant holds as many files as it may (`batches.max_files`): a 400."""

    def __init__(self, held: int, cap: int) -> None:
        super().__init__(f"this tenant holds {held} files, the most it may ({cap}); delete some first")

    def wire_error(self) -> WireError:
        return WireError(400, str(self), INVALID_REQUEST, "file", "file_limit_reached")


_FILE_COLUMNS = "id, tenant, purpose, filename, bytes, created_at, expires_at"
_BATCH_COLUMNS = "id, tenant, api, key_id, status, created_at, expires_at, num_lines, detail"


def _file_row(found: dict[str, Any]) -> FileRow:
    return FileRow(
        found["id"], found["tenant"], found["purpose"], found["filename"], int(found["bytes"]),
        int(found["created_at"]), found["expires_at"],
    )  # fmt: skip


def _batch_row(found: dict[str, Any]) -> BatchRow:
    return BatchRow(
        found["id"], found["tenant"], found["api"], found["key_id"], found["status"],
        int(found["created_at"]), int(found["expires_at"]), int(found["num_lines"]), dict(found["detail"]),
    )  # fmt: skip


def _line_row(found: dict[str, Any]) -> LineRow:
    return LineRow(found["idx"], found["custom_id"], found["request"], found["outcome"], found["result"])


def _json(value: dict[str, Any] | None) -> Jsonb | None:
    return None if value is None else Jsonb(storable(value))


def storable(value: dict[str, Any]) -> dict[str, Any]:
    """`value` as PostgreSQL's jsonb takes it: no NUL character (\\u0000 becomes U+FFFD) and no lone
    surrogate (it becomes '?')."""
    text = json.dumps(value, ensure_ascii=False).replace("\\u0000", "\\ufffd")
    result: dict[str, Any] = json.loads(text.encode("utf-8", "replace").decode("utf-8"))
    return result
