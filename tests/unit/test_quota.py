"""Tenants' limits as one count (gateway.quota): the buckets' arithmetic and OpenAI's headers; one host's store across
real processes (the rate within 5%, concurrency, a dead process's slots); Redis across two "hosts" on a real
redis-server, leases that expire, and the fallback to the host's store while Redis is away, and back."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import time

import pytest

from gateway import quota
from gateway.quota import HostQuota, RedisQuota, Rules, Verdict, duration, usage_now
from tests.helpers import free_port, start_redis, stop_process


def test_durations_and_headers_are_openais():
    assert [duration(s) for s in (0.12, 0.9999, 1, 6, 59.5, 90, 3600)] == \
        ["120ms", "1000ms", "1s", "6s", "1m0s", "1m30s", "1h0m0s"]
    v = Verdict(False, "requests", 0.3, 600, 0, 10.0, 1000, 40, 2.5)
    assert v.headers() == {"x-ratelimit-limit-requests": "600", "x-ratelimit-remaining-requests": "0",
                           "x-ratelimit-reset-requests": "10s", "x-ratelimit-limit-tokens": "1000",
                           "x-ratelimit-remaining-tokens": "40", "x-ratelimit-reset-tokens": "3s", "Retry-After": "1"}
    assert Verdict(True).headers() == {}
    assert Rules(600, 1000, 5).divided(2) == Rules(300, 500, 3) and Rules(None, None, 1).divided(4) == Rules(None,
                                                                                                                None, 1)


def test_a_bucket_bursts_ten_seconds_then_refuses_and_tokens_go_into_debt(tmp_path):
    q = HostQuota(str(tmp_path), 0)
    rules = Rules(requests_per_minute=600, tokens_per_minute=600)
    passed = [q.admit_now("t", rules).allowed for _ in range(101)]
    assert passed.count(True) == 100 and not passed[-1]  # 10 s of 10 a second
    refused = q.admit_now("t", rules)
    assert refused.reason == "requests" and 0 < refused.retry_after <= 0.1 and refused.remaining_requests == 0
    q.charge_now("t", rules, 150)  # a tokens bucket of 100 now owes 50 (48.8 after 0.12 s of refill)
    time.sleep(0.12)
    v = q.admit_now("t", rules)
    assert not v.allowed and v.reason == "tokens" and 4.7 <= v.retry_after <= 5.0 and v.remaining_tokens == 0
    other = q.admit_now("u", rules)  # another tenant: its own buckets
    assert other.allowed and other.remaining_requests == 99 and other.headers()["x-ratelimit-reset-requests"] == "100ms"


def _hammer(directory: str, rules: Rules, start: float, until: float, out) -> None:
    q = HostQuota(directory, os.getpid())
    n = 0
    while time.monotonic() < start:
        pass
    while time.monotonic() < until:
        n += q.admit_now("shared", rules).allowed
    out.put(n)


def test_four_processes_share_one_rate_within_five_percent(tmp_path):
    rules = Rules(requests_per_minute=6000)  # 100 a second, a burst of 1000
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    start = time.monotonic() + 0.5
    window = 3.0
    procs = [ctx.Process(target=_hammer, args=(str(tmp_path), rules, start, start + window, out)) for _ in range(4)]
    for p in procs:
        p.start()
    counts = [out.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(10)
    expected = 1000 + 100 * window
    assert all(counts) and abs(sum(counts) - expected) <= 0.05 * expected, (counts, expected)


def _take(directory: str, n: int, rules: Rules, ready, done) -> None:
    q = HostQuota(directory, 1)
    ready.put(sum(q.admit_now("c", rules).allowed for _ in range(n)))
    done.wait(30)


def test_concurrency_counts_every_process_and_a_dead_ones_slots_are_freed(tmp_path):
    rules = Rules(max_concurrent=3)
    ctx = multiprocessing.get_context("fork")
    ready, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_take, args=(str(tmp_path), 2, rules, ready, done))
    p.start()
    assert ready.get(timeout=30) == 2
    here = HostQuota(str(tmp_path), 0)
    lease = here.admit_now("c", rules)
    assert lease.allowed and not here.admit_now("c", rules).allowed  # 2 there + 1 here
    assert HostQuota(str(tmp_path), None).levels("c", rules)["concurrent"] == 3  # a reader clears nothing
    here.release_now(lease.lease)
    here.release_now(lease.lease)  # (twice: never below zero)
    assert here.levels("c", rules)["concurrent"] == 2
    p.kill()  # dies holding 2
    p.join(10)
    fresh = HostQuota(str(tmp_path), 2)  # a replacement gateway opens the tenant: the dead process's cells go
    assert [fresh.admit_now("c", rules).allowed for _ in range(4)] == [True, True, True, False]
    assert usage_now(str(tmp_path), None, "c", rules)["concurrent"] == 3


@pytest.fixture()
def redis_box(tmp_path):
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    port = free_port()
    box = {"port": port, "proc": start_redis(port, tmp_path), "dir": tmp_path}
    yield box
    stop_process(box["proc"])


def test_two_hosts_share_one_rate_and_concurrency_through_redis(redis_box, tmp_path):
    url = f"redis://127.0.0.1:{redis_box['port']}/0"

    async def run() -> tuple[int, list[bool], dict]:
        a = RedisQuota(url, "host-a", HostQuota(str(tmp_path / "a"), 0))
        b = RedisQuota(url, "host-b", HostQuota(str(tmp_path / "b"), 0))
        rules = Rules(requests_per_minute=600)
        passed = 0
        for i in range(150):
            passed += (await (a if i % 2 else b).admit("t", rules)).allowed
        pair = Rules(max_concurrent=2)
        first, second = await a.admit("p", pair), await b.admit("p", pair)
        third = await a.admit("p", pair)
        await b.release(second.lease)
        fourth = await a.admit("p", pair)
        usage = await b.usage("p", pair)
        await a.close()
        await b.close()
        return passed, [first.allowed, second.allowed, third.allowed, fourth.allowed], usage

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    passed, slots, usage = asyncio.run(run())
    assert 100 <= passed <= 101, passed  # one burst between both hosts (and a request's refill at most)
    assert slots == [True, True, False, True] and usage["concurrent"] == 2


def test_a_dead_hosts_leases_expire(redis_box, tmp_path, monkeypatch):
    monkeypatch.setattr(quota, "LEASE_TTL_S", 0.3)
    url = f"redis://127.0.0.1:{redis_box['port']}/0"

    async def run() -> tuple[bool, bool]:
        dead = RedisQuota(url, "dead", HostQuota(str(tmp_path), 0))
        live = RedisQuota(url, "live", HostQuota(str(tmp_path), 0))
        one = Rules(max_concurrent=1)
        assert (await dead.admit("e", one)).allowed
        refused = (await live.admit("e", one)).allowed
        await asyncio.sleep(0.5)  # dead never renews
        after = (await live.admit("e", one)).allowed
        await live.close()
        return refused, after

    assert asyncio.run(run()) == (False, True)


def test_without_redis_a_host_takes_its_share_and_goes_back_when_it_answers(redis_box, tmp_path, monkeypatch,
                                                                             caplog):
    monkeypatch.setattr(quota, "RETRY_S", 0.2)
    url = f"redis://127.0.0.1:{redis_box['port']}/0"
    rules = Rules(requests_per_minute=600)

    async def run() -> tuple[int, int, bool]:
        q = RedisQuota(url, "h", HostQuota(str(tmp_path), 0))
        q.hosts = 2  # (as read from the supervisors' heartbeats while Redis was up)
        assert (await q.admit("x", rules)).allowed
        stop_process(redis_box["proc"])
        away = sum([(await q.admit("x", rules)).allowed for _ in range(80)])  # the host's half: a burst of 50
        redis_box["proc"] = start_redis(redis_box["port"], redis_box["dir"])
        await asyncio.sleep(0.3)
        back = (await q.admit("x", rules)).allowed and not q.down
        await q.close()
        return away, q.hosts, back

    with caplog.at_level(logging.WARNING, logger="zserve.gateway"):
        away, hosts, back = asyncio.run(run())
    assert away == 50 and hosts == 2 and back
    warnings = [r.getMessage() for r in caplog.records if "tenant limits" in r.getMessage()]
    assert len(warnings) == 2 and "unreachable" in warnings[0] and "answers again" in warnings[1], warnings
    assert "127.0.0.1" in warnings[0]
