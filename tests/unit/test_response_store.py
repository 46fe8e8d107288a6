"""The Responses-API store keeps its promises on both backends: SQLite, and a real redis-server.

Each test runs against a URL, exactly as gateways would open it; the Redis tests start their own
``redis-server`` on a free port (skipped where it is not installed). Atomicity is checked across
two OS processes, as two gateway processes would race.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import orjson
import pytest

from gateway.store import MAX_RECORD_BYTES, ResponseStore, StoreUnavailable, open_store
from tests.helpers import free_port, read_line

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)


async def wait_until_async(cond: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.fixture(params=["sqlite", "redis"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty store's URL, for each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/responses.db"
    import redis

    port = request.getfixturevalue("redis_port")
    with redis.Redis(port=port) as client:
        client.flushdb()
    return f"redis://127.0.0.1:{port}/0"


def store(url: str, ttl_s: float = 60.0, max_items: int = 1000) -> ResponseStore:
    return open_store(url, "/nonexistent/unused.db", ttl_s=ttl_s, max_items=max_items)


def stored_count(url: str) -> int:
    """How many records the backend holds, expired-but-unreclaimed ones included."""
    if url.startswith("sqlite:"):
        with sqlite3.connect(url[len("sqlite://"):]) as db:
            return db.execute("SELECT count(*) FROM responses").fetchone()[0]
    import redis

    with redis.Redis.from_url(url) as client:
        indexed = client.zcard("zserve:resp:created")
        assert indexed == client.zcard("zserve:resp:expires")
        assert len(client.keys("zserve:resp:r:*")) <= indexed  # an evicted record's key goes with its entry
        return indexed


def test_put_get_round_trip_and_missing_key(url: str) -> None:
    async def body() -> None:
        s = store(url)
        record = {"id": "resp_1", "status": "completed", "output": [{"type": "message", "content": []}],
                  "usage": {"input_tokens": 3}, "text": "héllo ✓", "n": None}
        await s.put("resp_1", record)
        assert await s.get("resp_1") == record
        assert await s.get("resp_missing") is None
        await s.put("resp_1", {**record, "status": "failed"})  # replace
        assert (await s.get("resp_1"))["status"] == "failed"
        await s.close()

    run(body())


def test_records_expire_ttl_after_last_write(url: str) -> None:
    async def body() -> None:
        s = store(url, ttl_s=0.3)
        await s.put("a", {"status": "in_progress"})
        assert await s.get("a") == {"status": "in_progress"}

        async def gone() -> bool:
            return await s.get("a") is None

        await wait_until_async(gone, "the record to expire", timeout_s=5)
        assert await s.transition("a", ["in_progress"], {"status": "cancelled"}) == (False, None)
        await s.close()

    run(body())


def test_expired_records_are_reclaimed_by_later_puts(url: str) -> None:
    async def body() -> None:
        short = store(url, ttl_s=0.2)
        for i in range(5):
            await short.put(f"old{i}", {"status": "completed"})

        async def all_gone() -> bool:
            return all([await short.get(f"old{i}") is None for i in range(5)])

        await wait_until_async(all_gone, "the records to expire", timeout_s=5)
        await short.close()
        s = store(url)
        await s.put("new", {"status": "queued"})
        assert stored_count(url) == 1
        await s.close()

    run(body())


def test_size_bound_evicts_the_oldest_by_creation(url: str) -> None:
    async def body() -> None:
        s = store(url, max_items=3)
        for key in "abc":
            await s.put(key, {"status": "in_progress", "key": key})
        await s.put("a", {"status": "completed", "key": "a"})  # replacing keeps a's place: still the oldest
        assert (await s.transition("b", ["in_progress"], {"status": "completed"}))[0]
        await s.put("d", {"status": "queued"})
        assert [await s.get(k) is not None for k in "abcd"] == [False, True, True, True]
        await s.put("e", {"status": "queued"})
        assert [await s.get(k) is not None for k in "bcde"] == [False, True, True, True]
        assert stored_count(url) == 3
        await s.close()

    run(body())


def test_transition_only_from_allowed_statuses(url: str) -> None:
    async def body() -> None:
        s = store(url)
        await s.put("r", {"id": "r", "status": "in_progress", "output": []})
        ok, rec = await s.transition("r", {"queued", "in_progress"}, {"status": "cancelled"})
        assert ok and rec == {"id": "r", "status": "cancelled", "output": []}
        assert await s.get("r") == rec
        # "write the final result unless it was cancelled meanwhile": refused, and told what is there
        ok, current = await s.transition("r", ["in_progress"], {"status": "completed", "output": ["x"]})
        assert (ok, current) == (False, rec)
        assert await s.get("r") == rec
        assert await s.transition("nope", ["in_progress"], {"status": "cancelled"}) == (False, None)
        await s.put("nostatus", {"id": "nostatus"})
        assert await s.transition("nostatus", ["in_progress"], {"status": "x"}) == (False, {"id": "nostatus"})
        await s.close()

    run(body())


def test_two_stores_see_each_others_writes(url: str) -> None:
    async def body() -> None:
        one, two = store(url), store(url)  # as two gateway processes would open it
        await one.put("r", {"status": "queued"})
        assert await two.get("r") == {"status": "queued"}
        assert (await two.transition("r", ["queued"], {"status": "cancelled"}))[0]
        assert await one.get("r") == {"status": "cancelled"}
        await one.close()
        await two.close()

    run(body())


def test_delete_removes_the_record_for_every_store(url: str) -> None:
    async def body() -> None:
        one, two = store(url, max_items=2), store(url, max_items=2)
        await one.put("a", {"status": "completed"})
        assert await two.delete("a") is True
        assert await one.get("a") is None and await one.delete("a") is False
        assert await one.transition("a", ["completed"], {"status": "x"}) == (False, None)
        # A deleted record no longer counts towards the size bound.
        await one.put("b", {"status": "completed"})
        await one.put("c", {"status": "completed"})
        assert await two.get("b") == {"status": "completed"}
        await one.close()
        await two.close()

    run(body())


def test_oversize_records_are_refused(url: str) -> None:
    async def body() -> None:
        s = store(url)
        with pytest.raises(ValueError, match="limit"):
            await s.put("big", {"status": "completed", "blob": "x" * MAX_RECORD_BYTES})
        assert await s.get("big") is None
        await s.put("r", {"status": "in_progress"})
        with pytest.raises(ValueError, match="limit"):
            await s.transition("r", ["in_progress"], {"status": "completed", "blob": "x" * MAX_RECORD_BYTES})
        assert await s.get("r") == {"status": "in_progress"}
        await s.close()

    run(body())


# One gateway-like process: opens the store, says "ready", waits for the start file, then fires
# every transition at once and prints the ones it won.
_RACER = r"""
import asyncio, os, sys, time
import orjson
from gateway.store import open_store

url, start, n_keys, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

async def main():
    s = open_store(url, "/nonexistent/unused.db", ttl_s=60, max_items=10_000)
    await s.get("warm-up")
    print("ready", flush=True)
    deadline = time.monotonic() + 20
    while not os.path.exists(start):
        if time.monotonic() > deadline:
            sys.exit("no start signal")
        await asyncio.sleep(0.001)
    me = os.getpid()

    async def one(key, i):
        ok, rec = await s.transition(key, ["in_progress"], {"status": f"done-{me}-{i}"})
        return [key, ok, rec["status"]]

    results = await asyncio.gather(*(one(f"k{k}", i) for i in range(rounds) for k in range(n_keys)))
    await s.close()
    print(orjson.dumps(results).decode(), flush=True)

asyncio.run(main())
"""


@pytest.mark.timeout(60)
def test_transition_is_atomic_across_processes(url: str, tmp_path: Path) -> None:
    n_keys, rounds = 20, 10

    async def seed() -> None:
        s = store(url)
        for k in range(n_keys):
            await s.put(f"k{k}", {"status": "in_progress", "k": k})
        await s.close()

    run(seed())
    start = tmp_path / "start"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, url, str(start), str(n_keys), str(rounds)],
                               cwd=REPO, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for p in racers:
            assert read_line(p, 30, what="a racer to be ready").strip() == "ready"
        start.touch()
        outputs = [p.communicate(timeout=45)[0] for p in racers]
    finally:
        for p in racers:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in racers] == [0, 0]
    results = [r for out in outputs for r in orjson.loads(out)]
    assert len(results) == 2 * n_keys * rounds

    async def final() -> dict[str, str]:
        s = store(url)
        got = {f"k{k}": (await s.get(f"k{k}"))["status"] for k in range(n_keys)}
        await s.close()
        return got

    stored = run(final())
    for k in range(n_keys):
        key = f"k{k}"
        wins = [status for rk, ok, status in results if rk == key and ok]
        assert len(wins) == 1, f"{key}: {len(wins)} winners"
        assert stored[key] == wins[0]
        assert all(status == wins[0] for rk, ok, status in results if rk == key)  # losers saw the winner's record


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["tcp", "unix"])
def test_redis_not_listening_raises_store_unavailable_quickly(where: str, tmp_path: Path) -> None:
    pytest.importorskip("redis")
    url = f"redis://127.0.0.1:{free_port()}/0" if where == "tcp" else f"unix://{tmp_path}/none.sock?db=0"
    s = open_store(url, "/nonexistent/unused.db", ttl_s=60, max_items=10)

    async def body() -> None:
        for call in (lambda: s.get("r"), lambda: s.put("r", {"status": "queued"}),
                     lambda: s.transition("r", ["queued"], {"status": "cancelled"})):
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable, match="127.0.0.1" if where == "tcp" else "none.sock"):
                await call()
            assert time.monotonic() - t0 < 5
        await s.close()

    run(body())


def test_open_store_rejects_unknown_schemes_and_relative_paths(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"sqlite:///.*redis://"):
        open_store("postgres://db/responses", str(tmp_path / "x.db"), ttl_s=60, max_items=10)
    with pytest.raises(ValueError, match="absolute"):
        open_store("sqlite://responses.db", str(tmp_path / "x.db"), ttl_s=60, max_items=10)
    with pytest.raises(ValueError, match="ttl_s"):
        open_store(None, str(tmp_path / "x.db"), ttl_s=0, max_items=10)
    with pytest.raises(ValueError, match="max_items"):
        open_store(None, str(tmp_path / "x.db"), ttl_s=60, max_items=0)


def test_default_sqlite_file_is_private(tmp_path: Path) -> None:
    path = tmp_path / "run" / "responses.db"
    old = os.umask(0)  # the mode must not depend on a permissive umask
    try:
        s = open_store(None, str(path), ttl_s=60, max_items=10)
        run(s.put("r", {"status": "queued"}))
    finally:
        os.umask(old)
    files = [f for f in path.parent.iterdir() if f.name.startswith("responses.db")]
    assert path in files
    for f in files:  # the database, and the -wal/-shm files WAL mode adds
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"

    async def close() -> None:
        await s.close()

    run(close())


def test_sqlite_io_errors_raise_store_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "garbage.db"
    path.write_bytes(b"this is not a database" * 1000)
    with pytest.raises(StoreUnavailable, match="garbage.db"):
        open_store(f"sqlite:///{path}", "/unused", ttl_s=60, max_items=10)


def test_sqlite_store_does_not_import_redis(tmp_path: Path) -> None:
    code = ("import sys; from gateway.store import open_store; "
            f"open_store(None, {str(tmp_path / 'r.db')!r}, ttl_s=1, max_items=1); "
            "assert 'redis' not in sys.modules, 'redis imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=30)


def test_a_gateway_opening_a_new_store_waits_out_another_ones_lock(tmp_path: Path):
    """Every gateway of a host opens the one SQLite file as it starts, together. Switching a new file to WAL does
    not wait on SQLite's busy handler: a gateway that found another one mid-open died at start with "database is
    locked" (1 round in 40 of 16 processes opening at once). Here the other gateway's lock is held on purpose:
    without the retry the open fails at once."""
    import threading

    from gateway.store.sqlite import SqliteStore

    path = str(tmp_path / "r.db")
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # what another gateway's open holds while it creates the schema
    opened: list[str] = []

    def open_it() -> None:
        try:
            SqliteStore(path, ttl_s=60, max_items=10)
            opened.append("ok")
        except Exception as e:  # noqa: BLE001 - reported to the test
            opened.append(repr(e))

    t = threading.Thread(target=open_it)
    t.start()
    t.join(0.3)  # long enough for an open that does not wait to fail
    assert t.is_alive() and not opened, f"the open did not wait for the lock: {opened}"
    other.execute("COMMIT")
    other.close()
    t.join(30)
    assert opened == ["ok"]
