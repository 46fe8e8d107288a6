"""The single-host response store: one SQLite file that every gateway process opens.

WAL mode lets readers run while one process writes; ``busy_timeout`` makes a process that finds the
write lock taken wait for it (up to ``BUSY_TIMEOUT_S``) instead of failing. Every write runs in one
``BEGIN IMMEDIATE`` transaction, which takes the write lock up front, so ``transition``'s read, check
and write cannot interleave with another process's.

sqlite3 calls block, and one may wait on another process's lock for up to the busy timeout, so they
run on a thread of the store's own (one per store, so the connection is only ever used by it).

Table ``responses``: ``seq`` (creation order, for evicting the oldest; an upsert keeps it), ``key``,
``expires`` (unix time, restarted by each write) and ``data`` (orjson bytes). Triggers keep the row
count in ``responses_count`` so the size bound costs O(1) per put, not a count over the table.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import orjson

from .base import ResponseStore, StoreUnavailable, encode_record, status_allows

T = TypeVar("T")

BUSY_TIMEOUT_S = 5.0  # how long a write waits for another process's lock before StoreUnavailable
PURGE_BATCH = 64  # expired rows deleted per put: bounded work, and more than a put adds

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL UNIQUE,
    expires REAL NOT NULL,
    data BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_expires ON responses(expires);
CREATE TABLE IF NOT EXISTS responses_count (n INTEGER NOT NULL);
INSERT INTO responses_count (n) SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM responses_count);
CREATE TRIGGER IF NOT EXISTS responses_counted_in AFTER INSERT ON responses
    BEGIN UPDATE responses_count SET n = n + 1; END;
CREATE TRIGGER IF NOT EXISTS responses_counted_out AFTER DELETE ON responses
    BEGIN UPDATE responses_count SET n = n - 1; END;
"""


def _unavailable(path: str, e: BaseException) -> StoreUnavailable:
    return StoreUnavailable(f"response store {path}: {e}")


def _is_io_error(e: sqlite3.Error) -> bool:
    # Locked past the busy timeout, disk I/O, disk full, a corrupt file: the store is unusable now.
    # Misuse (bad SQL, closed connection, constraint violations) stays a bug and propagates as is.
    return isinstance(e, sqlite3.DatabaseError) and not isinstance(
        e, (sqlite3.ProgrammingError, sqlite3.IntegrityError, sqlite3.InterfaceError))


def _create_schema(db: sqlite3.Connection) -> None:
    # One transaction, so gateways starting together create it once. (executescript rather than
    # _write: executescript commits any open transaction before running its script.)
    try:
        db.executescript(f"BEGIN IMMEDIATE;\n{_SCHEMA}\nCOMMIT;")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _while_locked(fn: Callable[[], object]) -> None:
    """Run ``fn`` again while it finds the file locked, up to the busy timeout. Switching a new file to WAL
    does not wait on the busy handler: gateways starting together saw "database is locked" at once."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            fn()
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class SqliteStore(ResponseStore):
    def __init__(self, path: str, *, ttl_s: float, max_items: int) -> None:
        self.path = path
        self.ttl_s = float(ttl_s)
        self.max_items = int(max_items)
        db: sqlite3.Connection | None = None
        try:
            parent = os.path.dirname(path)
            if parent:
                os.makedirs(parent, mode=0o700, exist_ok=True)
            # Created here with 0600 (sqlite would use 0644): other users must not read responses.
            # SQLite gives the -wal and -shm files the database file's permissions.
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
            # Autocommit mode (isolation_level=None): transactions are the explicit BEGIN IMMEDIATEs.
            # check_same_thread=False: opened here, then used only by the store's one thread.
            db = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
            db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            _while_locked(lambda: db.execute("PRAGMA journal_mode = WAL"))
            db.execute("PRAGMA synchronous = NORMAL")  # with WAL: never corrupt; a power cut may lose the last commits
            _while_locked(lambda: _create_schema(db))
        except (OSError, sqlite3.Error) as e:
            if db is not None:
                db.close()
            if isinstance(e, OSError) or _is_io_error(e):
                raise _unavailable(path, e) from e
            raise
        self._db = db
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zserve-response-store")
        self._closed = False

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)
        except sqlite3.Error as e:
            if _is_io_error(e):
                raise _unavailable(self.path, e) from e
            raise

    def _write(self, body: Callable[[], T]) -> T:
        """``body`` in one BEGIN IMMEDIATE transaction: committed if it returns, rolled back if it raises."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            result = body()
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        return result

    # -- the blocking halves, run on the store's thread --

    def _put(self, key: str, data: bytes) -> None:
        def body() -> None:
            db, now = self._db, time.time()  # the clock read once the write lock is ours
            db.execute("DELETE FROM responses WHERE seq IN "
                       "(SELECT seq FROM responses WHERE expires <= ? ORDER BY expires LIMIT ?)", (now, PURGE_BATCH))
            # Putting a key whose record has expired creates a new record (a new place in creation order).
            db.execute("DELETE FROM responses WHERE key = ? AND expires <= ?", (key, now))
            db.execute("INSERT INTO responses (key, expires, data) VALUES (?, ?, ?) "
                       "ON CONFLICT(key) DO UPDATE SET expires = excluded.expires, data = excluded.data",
                       (key, now + self.ttl_s, data))
            (n,) = db.execute("SELECT n FROM responses_count").fetchone()
            if n > self.max_items:
                db.execute("DELETE FROM responses WHERE seq IN (SELECT seq FROM responses ORDER BY seq LIMIT ?)",
                           (n - self.max_items,))

        self._write(body)

    def _get(self, key: str) -> bytes | None:
        row = self._db.execute("SELECT data FROM responses WHERE key = ? AND expires > ?",
                               (key, time.time())).fetchone()
        return row[0] if row else None

    def _transition(self, key: str, from_statuses: Collection[str], patch: dict) -> tuple[bool, dict | None]:
        def body() -> tuple[bool, dict | None]:
            now = time.time()
            row = self._db.execute("SELECT data FROM responses WHERE key = ? AND expires > ?", (key, now)).fetchone()
            if row is None:
                return False, None
            record = orjson.loads(row[0])
            if not status_allows(record, from_statuses):
                return False, record
            new = {**record, **patch}
            self._db.execute("UPDATE responses SET expires = ?, data = ? WHERE key = ?",
                             (now + self.ttl_s, encode_record(new), key))
            return True, new

        return self._write(body)

    def _delete(self, key: str) -> bool:
        def body() -> bool:
            live = self._db.execute("SELECT 1 FROM responses WHERE key = ? AND expires > ?",
                                    (key, time.time())).fetchone()
            self._db.execute("DELETE FROM responses WHERE key = ?", (key,))
            return live is not None

        return self._write(body)

    def _close(self) -> None:
        self._db.close()

    # -- ResponseStore --

    async def put(self, key: str, record: dict) -> None:
        data = encode_record(record)  # ValueError before touching the file
        await self._run(self._put, key, data)

    async def get(self, key: str) -> dict | None:
        data = await self._run(self._get, key)
        return None if data is None else orjson.loads(data)

    async def transition(self, key: str, from_statuses: Collection[str], patch: dict) -> tuple[bool, dict | None]:
        return await self._run(self._transition, key, from_statuses, patch)

    async def delete(self, key: str) -> bool:
        return await self._run(self._delete, key)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._run(self._close)
        finally:
            self._thread.shutdown(wait=False)
