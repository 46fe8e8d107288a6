"""Helpers shared by the tests (fixtures stay in the conftest.py files, which import these).

Every test that starts a process goes through ``Server`` (a `launch api-server` or `launch render`,
or any command that prints the ready line) or reads its output with ``read_line``: both give up
after a deadline, so a process that never answers fails its test instead of hanging the suite.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import orjson
import psutil

from protocol.control import StatusCommand, StatusReply
from zserve import control

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = [sys.executable, "-m", "launch"]
URL_RE = re.compile(r"zserve: serving (.+?) at ((?:http://|unix:|tcp://)\S+) ")


class Server:
    """A running `launch api-server` (or `launch render`); ``url`` is its base URL once ready."""

    def __init__(self, *args: str, ready_timeout: float = 240.0, log_name: str = "server", port: int = 0,
                 command: list[str] | None = None, env: dict[str, str] | None = None,
                 subcommand: str = "api-server", **popen):
        """Start ``launch SUBCOMMAND --port PORT ARGS`` (or ``command``, which must print the same ready
        line) with ``env`` added to the environment; ``popen`` goes to ``subprocess.Popen``."""
        self.args = [subcommand, "--port", str(port), *args]
        log_dir = Path(os.environ.get("ZSERVE_TEST_LOGS", "/tmp/zserve-test-logs"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{log_name}-{os.getpid()}-{time.monotonic_ns()}.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(command or [*LAUNCH, *self.args], cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=self.log, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **env} if env else None, **popen)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.url = self._wait_url(ready_timeout)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(raw.decode(errors="replace"))

    def _wait_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}: {self.tail()}") from None
                continue
            m = URL_RE.search(line)
            if m:
                return m.group(2)
        self.stop()
        raise RuntimeError(f"server not ready in {timeout}s: {self.tail()}")

    def tail(self, n: int = 3000) -> str:
        if not self.log.closed:  # (closed by stop(): a server that never got ready is stopped before its tail is read)
            self.log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def wait_until(cond, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll ``cond`` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def offer_paced(send, per_second: float, window: float, senders: int = 6) -> tuple[list, float]:
    """Call ``send(i)`` ``window * per_second`` times from ``senders`` threads, each call at its slot of an even
    pace from now on (a sender that falls behind sends at once). Returns every result and the span from the start
    to the last call's start: what a rate limit must be held to. On a busy machine the calls fall behind their
    slots, and the span, not ``window``, is how long the limit refilled."""
    results: list = []
    last = [0.0]
    start = time.monotonic()
    per_sender = int(window * per_second / senders)

    def sender(k: int) -> None:
        for i in range(per_sender):
            time.sleep(max(0.0, start + (i * senders + k) / per_second - time.monotonic()))
            last[0] = max(last[0], time.monotonic() - start)
            results.append(send(i * senders + k))

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results, last[0]


def streams_go_on(streams, at: list[int], what: str, more: int = 20, timeout: float = 60) -> None:
    """Wait until every stream has failed, read ``more`` chunks past ``at`` (the counts at some event: a kill, a
    drain) or ended with a finish reason (one that reached its last tokens sooner), as streams read by ``run_stream``
    (or any object with ``chunks``, ``error`` and ``finish``) do."""
    wait_until(lambda: all(s.error or s.chunks > n + more or s.finish is not None for s, n in zip(streams, at)),
               timeout, what=what)


def close_streams(streams, readers) -> None:
    """Have every stream's client close it at its next chunk (``leave``), then wait for its reader: a thread or a
    future."""
    for s in streams:
        s.leave.set()
    for r in readers:
        r.join(timeout=120) if isinstance(r, threading.Thread) else r.result(timeout=120)


def read_line(proc: subprocess.Popen, timeout: float, what: str = "a line of output") -> str:
    """The next line ``proc`` writes to its stdout pipe; AssertionError if none comes within ``timeout``."""
    assert proc.stdout is not None
    got: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: got.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = got.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None
    return line.decode(errors="replace") if isinstance(line, bytes) else line


def pinned_client(url: str, timeout: float = 60) -> httpx.Client:
    """A client on one keep-alive connection that stays open while idle, so every request reaches the gateway
    process that accepted it. httpx closes a connection idle for 5 s by default (``keepalive_expiry``) and opens
    a new one, which the kernel may hand to another process of the shared socket: a test pinning clients to
    processes then sees them move whenever it waits longer than that (on a loaded machine, a slow generation)."""
    return httpx.Client(base_url=url, timeout=timeout, limits=httpx.Limits(max_connections=1, keepalive_expiry=None))


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


_handed_out: set[int] = set()
_port_rng = random.Random()  # (seeded from os.urandom: two test processes do not walk the same ports)


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports, below the kernel's ephemeral range.

    A port the kernel picks for ``bind(("", 0))`` comes from the range it also takes the source ports of outgoing
    connections from: a fixed port handed to a process that binds it later (an engine host's engines, scaled up
    minutes after the fixture chose their ports) can meanwhile be the source port of some client's connection, and
    the bind fails with EADDRINUSE (one CI run lost an engine's KV event replay port so). Ports below that range
    are never handed out by the kernel; this process also never hands out one twice."""
    low = _ephemeral_low()
    start = 20000 if low > 21000 else 1024
    for _ in range(500):
        first = _port_rng.randrange(start, low - n)
        ports = range(first, first + n)
        if _handed_out.intersection(ports):
            continue
        socks = []
        try:
            for port in ports:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            _handed_out.update(ports)
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports below {low}")


def engine_host_ports(kv_events_port: bool = False) -> int:
    """How many ports from its ``--bind`` port an engine host of one model may take: its registry and every engine
    rank, then (without ``--kv-events-port``) two a rank for KV events (``launch.hosts.engine_registry``)."""
    from launch.hosts.engine_registry import engine_ports, kv_events_ports

    bind = "tcp://127.0.0.1:0"  # (from port 0 on, the end of the last range is the count)
    return (engine_ports(bind, 1) if kv_events_port else kv_events_ports(bind, 1)).stop


def free_port() -> int:
    """A free loopback port for a process to bind later (``free_ports``: outside the ephemeral range)."""
    return free_ports(1)


# -- a tiny-random server and what tests ask it --------------------------------------------------------
TINY = ("--model", "tiny-random", "--dtype", "float32")


def metric(url: str, name: str) -> float:
    """The sum of every sample of ``/metrics`` whose line starts with ``name`` (a metric, or a metric and the start
    of its labels: ``'zserve_migrations_total{cause="engine_lost"'``)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


@contextlib.contextmanager
def hosts_sharing(state_url: str, *args: str, log_name: str, count: int = 2):
    """Two hosts' servers (``--count`` gateways each, ``args`` beside) sharing ``--state-url state_url``: (a, b)."""
    a = Server(*args, "--count", str(count), "--state-url", state_url, log_name=f"{log_name}-a")
    try:
        b = Server(*args, "--count", str(count), "--state-url", state_url, log_name=f"{log_name}-b")
    except Exception:
        a.stop()
        raise
    try:
        yield a, b
    finally:
        for s in (a, b):
            s.stop()


def status(server: Server) -> dict:
    """What ``launch status --json`` prints for ``server``: its supervisor's ``StatusReply``, asked over the control
    socket in this process, as the command asks it. (A ``launch status`` process per poll cost half a second of
    CPU on a 2-core machine, where the servers under test run; the command itself is tested in test_supervisor.)"""
    reply = control.request(control.find_control_socket(server.port), StatusCommand(), 30)
    assert isinstance(reply, StatusReply), reply
    return orjson.loads(orjson.dumps(reply.to_wire()))


def procs(server: Server, tier: str) -> list[dict]:
    return [p for p in status(server)["processes"] if p["tier"] == tier]


def ready_pids(server: Server, tier: str) -> list[int]:
    return [p["pid"] for p in procs(server, tier) if p["state"] == "ready"]


def complete(url: str, max_tokens: int = 4) -> httpx.Response:
    # A fresh connection per request, as separate clients behind a load balancer would make.
    with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        return c.post(url + "/v1/completions", json={"model": "tiny-random", "prompt": "hi", "max_tokens": max_tokens})


def stream_body(max_tokens: int) -> dict:
    return {"model": "tiny-random", "prompt": "hello", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}


class StreamResult:
    def __init__(self):
        self.chunks = 0
        self.error: dict | None = None
        self.finish: str | None = None
        self.ended_at: float | None = None
        self.done = False
        self.leave = threading.Event()  # set: the client closes the stream at its next chunk of tokens


def collect_finishes(response: httpx.Response, out: list) -> None:
    """Append the finish reason of every choice of every SSE chunk of ``response`` to ``out`` as it arrives (None
    until a choice ends): a test watches a stream go on, then sees how it ended."""
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.extend(c["finish_reason"] for c in orjson.loads(line[6:])["choices"])


def run_stream(url: str, body: dict, res: StreamResult) -> None:
    try:
        _read_stream(url, body, res)
    except httpx.HTTPError as e:  # the server went away mid-stream (a fast stop)
        res.error = {"message": f"connection lost: {e}"}
    res.ended_at = res.ended_at or time.monotonic()


def _read_stream(url: str, body: dict, res: StreamResult) -> None:
    with httpx.Client(timeout=120) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                res.done = True
                break
            msg = orjson.loads(data)
            if "error" in msg:
                res.error = msg["error"]
                res.ended_at = time.monotonic()
            else:
                res.chunks += 1
                res.finish = msg["choices"][0]["finish_reason"] or res.finish
                if res.leave.is_set():
                    break


class Traffic:
    """A bounded stream of concurrent requests as users send them: streamed and sampled (T=1.0) completions
    and chat for ``model``, through the official SDK without retries; counts what succeeded and what failed.
    ``keepalive=False``: a new connection for every request (the kernel then picks a gateway for each)."""

    def __init__(self, url: str, model: str, workers: int = 4, keepalive: bool = True):
        import openai

        http = None if keepalive else httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=120)
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120, http_client=http)
        self.model = model
        self.stop = threading.Event()
        self.ok = 0
        self.failed: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(workers)]

    def _run(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                if (i + n) % 2:
                    chunks = self.client.completions.create(model=self.model, prompt=f"request {i}.{n}: once upon a",
                                                            max_tokens=12, stream=True)
                    text = "".join(c.choices[0].text for c in chunks if c.choices)
                else:
                    r = self.client.chat.completions.create(model=self.model, max_tokens=12,
                                                            messages=[{"role": "user", "content": f"hi {i} {n}"}])
                    text = r.choices[0].message.content
                assert text is not None
                self.ok += 1
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                self.failed.append(f"{type(e).__name__}: {e}")

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        wait_until(lambda: self.ok >= 4, 60, what="the traffic to flow")
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(120)


def start_redis(port: int, workdir: Path) -> subprocess.Popen:
    """A private redis-server on loopback ``port`` that persists nothing, once it answers PING (10 s at most)."""
    import shutil

    import redis

    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is not installed (.ci/run installs it)"
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    client = redis.Redis(port=port, socket_connect_timeout=1, socket_timeout=1)
    deadline = time.monotonic() + 10
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"redis-server exited with {proc.returncode}")
            try:
                if client.ping():
                    return proc
            except redis.ConnectionError:
                pass
            if time.monotonic() > deadline:
                stop_process(proc)
                raise AssertionError(f"redis-server on port {port} did not answer within 10s")
            time.sleep(0.01)
    finally:
        client.close()


def stop_process(proc: subprocess.Popen, timeout: float = 10) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
