"""Soak: random SIGKILLs of gateways and engines under openai-SDK traffic, for minutes (opt-in).

    ZSERVE_SOAK=1 [ZSERVE_SOAK_SECONDS=300] [ZSERVE_SOAK_KILL_EVERY=10] \\
        .venv/bin/python -m pytest tests/soak/test_random_kills.py -s -q

Two gateways and two engines of the tiny random model serve six SDK clients (chat and streamed completions,
the SDK's own retries on) while a random child is SIGKILLed every ``ZSERVE_SOAK_KILL_EVERY`` seconds; one kill
in three hits the slot it hit last as soon as its replacement runs (quick deaths of one slot, the supervisor's
restart and publish races), as long as that slot stays out of a crash loop. The supervisor must live through
it all; at the end every process is back (the count and live pids that ``launch status`` shows, and no other
gateway or engine under the supervisor) and the server serves. Skipped by default: it takes minutes.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from functools import partial

import openai
import psutil
import pytest

from tests.helpers import TINY, Server, procs, status, wait_until

pytestmark = pytest.mark.skipif(os.environ.get("ZSERVE_SOAK") != "1",
                                reason="opt-in soak: ZSERVE_SOAK=1 (minutes long)")

SECONDS = float(os.environ.get("ZSERVE_SOAK_SECONDS", "300"))
KILL_EVERY = float(os.environ.get("ZSERVE_SOAK_KILL_EVERY", "10"))
CLIENTS = 6
QUICK_DEATHS_PER_MINUTE = 3  # per slot: five within 60 s would be a crash loop, which is not what this tests


class Clients:
    """Six SDK clients as users run them (default retries), counting what succeeded and how the rest failed."""

    def __init__(self, url: str):
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=60)
        self.stop = threading.Event()
        self.ok = 0
        self.failed: Counter[str] = Counter()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(CLIENTS)]

    def _run(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                if n % 2:
                    r = self.client.chat.completions.create(model="tiny-random", max_tokens=16,
                                                            messages=[{"role": "user", "content": f"hi {i} {n}"}])
                    assert r.choices[0].message.content is not None
                else:
                    chunks = self.client.completions.create(model="tiny-random", prompt=f"{i}.{n} once upon a",
                                                            max_tokens=16, stream=True)
                    assert "".join(c.choices[0].text for c in chunks if c.choices) is not None
                self.ok += 1
            except Exception as e:  # noqa: BLE001 - counted: a kill may end a request that was on its process
                self.failed[why(e)] += 1

    def __enter__(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)


def why(e: BaseException) -> str:
    """An error with its causes ("APIConnectionError <- ConnectError: [Errno 111] Connection refused")."""
    chain = [f"{type(e).__name__}: {str(e)[:60]}"]
    while (e := e.__cause__ or e.__context__) is not None and len(chain) < 4:  # type: ignore[assignment]
        chain.append(f"{type(e).__name__}: {str(e)[:60]}")
    return " <- ".join(chain)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def children_of(server: Server) -> set[int]:
    """The gateways and engines running under the supervisor, whatever it says of them."""
    found = set()
    for p in server.descendants():
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if running(p.pid) and ("-m gateway" in cmd or "engine_worker" in cmd or "zserve: " in cmd) \
                and "preload" not in cmd:  # (a zygote: launch/zygote.py)
            found.add(p.pid)
    return found


def replacement(server: Server, slot: str, killed: int) -> dict | None:
    """The process now in ``slot`` ("engine 0") once it runs (starting or ready), if it is not ``killed``."""
    tier = slot.split()[0]
    return next((p for p in procs(server, tier) if f"{tier} {p['index']}" == slot and p["pid"] not in (None, killed)),
                None)


def all_back(server: Server) -> dict[str, int] | None:
    """Every slot's process ready and alive, and no other gateway or engine: ``{"gateway 0": pid, ...}``."""
    ps = status(server)["processes"]
    ready = {f"{p['tier']} {p['index']}": p["pid"] for p in ps if p["state"] == "ready" and running(p["pid"])}
    if len(ready) == len(ps) == 4 and set(ready.values()) == children_of(server):
        return ready
    return None


@pytest.mark.timeout(SECONDS + 600)
def test_the_server_serves_through_random_kills_and_every_process_comes_back():
    s = Server("--count", "2", "--engines", "2", *TINY, log_name="soak-kills")
    rng = random.Random(os.environ.get("ZSERVE_SOAK_SEED"))
    kills: list[tuple[float, str, int]] = []
    quick: dict[str, list[float]] = {}
    try:
        first = all_back(s)
        assert first is not None, status(s)
        with Clients(s.url) as clients:
            wait_until(lambda: clients.ok >= CLIENTS, 60, what="the traffic to flow")
            t0 = time.monotonic()
            last = ""
            while time.monotonic() - t0 < SECONDS:
                ok_before = clients.ok
                time.sleep(KILL_EVERY)  # the soak's own pace between kills
                assert s.proc.poll() is None, f"the supervisor exited with {s.proc.returncode}: {s.tail(4000)}"
                assert clients.ok > ok_before, f"no request succeeded in {KILL_EVERY}s: {clients.failed}"
                now = time.monotonic()
                recent = [t for t in quick.get(last, []) if now - t < 60]
                if last and rng.random() < 1 / 3 and len(recent) < QUICK_DEATHS_PER_MINUTE:
                    victim = wait_until(partial(replacement, s, last, kills[-1][2]), 60, 0.01, f"{last}'s replacement")
                    quick[last] = [*recent, now]
                else:
                    victim = rng.choice([p for p in status(s)["processes"] if p["pid"] and p["state"] == "ready"])
                last = f"{victim['tier']} {victim['index']}"
                os.kill(victim["pid"], signal.SIGKILL)
                kills.append((round(time.monotonic() - t0, 1), last, victim["pid"]))
            back = wait_until(lambda: all_back(s), 120, 0.5, "every process back")
            served = clients.ok
            wait_until(lambda: clients.ok >= served + 2 * CLIENTS, 60, what="traffic after the last kill")
        assert s.proc.poll() is None, s.tail(4000)
        r = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model="tiny-random", max_tokens=4, messages=[{"role": "user", "content": "still there?"}])
        assert r.choices[0].message.content is not None
        assert not set(back.values()) & {pid for _, _, pid in kills}  # every killed process was replaced
        print(f"\nsoak: {SECONDS:.0f}s, {len(kills)} kills ({sum(len(v) for v in quick.values())} quick), "
              f"{clients.ok} requests ok, {sum(clients.failed.values())} failed: {dict(clients.failed)}")
        print("kills (s, slot, pid):", kills)
    finally:
        code = s.stop()
    assert code == 0, s.tail(4000)
