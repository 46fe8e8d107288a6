"""The supervisor keeps the service up: crashes, hangs, scaling, draining and cluster-wide control.

Every test runs real `launch api-server` processes with the tiny random model and talks to them
over real HTTP and the real control socket.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import psutil
import pytest

from launch.supervisor import EXIT_SUPERVISOR_FAILED
from tests.helpers import (
    LAUNCH,
    ROOT,
    TINY,
    Server,
    StreamResult,
    close_streams,
    complete,
    procs,
    ready_pids,
    run_stream,
    status,
    stream_body,
    streams_go_on,
    wait_until,
)


def engine_sockets(*ranks: int) -> list[str]:
    """The socket files engines of ``ranks`` keep in the run directory (each its own and its KV events'), sorted."""
    return sorted(f"engine-{r}{suffix}.sock" for r in ranks for suffix in ("", "-kv", "-kv-replay"))


def test_without_migration_engine_death_fails_its_requests_within_a_second_and_a_replacement_joins():
    """``--migration-limit 0``: what every stream on a dead engine got before migration (tests/e2e/test_migration.py),
    an error event within a second."""
    s = Server("--count", "2", "--engines", "2", "--max-model-len", "8192", "--migration-limit", "0", *TINY,
               log_name="engine-death")
    try:
        results = [StreamResult() for _ in range(4)]
        threads = [threading.Thread(target=run_stream, args=(s.url, stream_body(6000), r)) for r in results]
        for t in threads:
            t.start()
        wait_until(lambda: all(r.chunks > 3 for r in results), 30, what="all 4 streams to flow")
        # heartbeats carry each engine's load to the supervisor about once a second
        def loaded_engines():
            e = procs(s, "engine")
            return e if sum(p.get("running", 0) for p in e) == 4 else None

        engines = wait_until(loaded_engines, 10, what="the engines to report the 4 streams")
        victim = max(engines, key=lambda p: p.get("running", 0))
        killed_at = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        # a new request succeeds at once, on the surviving engine, and /health says the tier is degraded
        assert complete(s.url).status_code == 200
        wait_until(lambda: httpx.get(s.url + "/health").json()["status"] == "degraded", 2, what="/health: degraded")
        at_kill = [r.chunks for r in results]
        # The streams on the surviving engine flow on (far from their 6,000 tokens): seen, they are closed.
        streams_go_on(results, at_kill, "the surviving streams to flow on after the kill", more=50)
        close_streams(results, threads)
        failed = [r for r in results if r.error]
        assert failed, "no stream was on the killed engine"
        for r in failed:
            assert r.ended_at - killed_at < 1.0, f"stream ended {r.ended_at - killed_at:.2f}s after the kill"
            assert "lost engine" in r.error["message"] and r.done
        # the replacement joins and takes traffic
        wait_until(lambda: len(ready_pids(s, "engine")) == 2 and victim["pid"] not in ready_pids(s, "engine"), 60,
                   what="a replacement engine")
        run_dir = status(s)["run_dir"]
        assert sorted(f for f in os.listdir(run_dir) if f.endswith(".sock")) == ["control.sock", *engine_sockets(0, 1)]
        replacement = next(p for p in procs(s, "engine") if p["index"] == victim["index"])
        assert replacement["restarts"] == 1

        def replacement_served() -> bool:
            with ThreadPoolExecutor(4) as ex:
                assert all(r.status_code == 200 for r in ex.map(lambda _: complete(s.url, 8), range(8)))
            load = httpx.get(s.url + "/metrics").text
            key = f'zserve_engine_generated_tokens_total{{engine="{victim["index"]}",model="tiny-random"}}'
            line = next((ln for ln in load.splitlines() if ln.startswith(key)), "")
            return line and float(line.split()[-1]) > 0

        wait_until(replacement_served, 60, interval=0.2, what="the replacement engine to serve requests")
        assert httpx.get(s.url + "/health").json() == {"status": "ok", "engines_ready": 2, "engines_desired": 2,
                                                      "paused": False, "models": {"tiny-random": {
                                                          "engines_ready": 2, "engines_desired": 2}}}
    finally:
        s.stop()


def test_gateway_killed_under_load_is_replaced_and_others_serve_every_new_request():
    s = Server("--count", "3", *TINY, log_name="gateway-death")
    try:
        victim = ready_pids(s, "gateway")[0]
        results: list[tuple[float, int]] = []
        stop = threading.Event()

        def load():
            while not stop.is_set():
                try:
                    results.append((time.monotonic(), complete(s.url).status_code))
                except httpx.HTTPError:
                    results.append((time.monotonic(), -1))

        t = threading.Thread(target=load)
        t.start()
        wait_until(lambda: len(results) >= 10, 30, what="steady load")
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_until(lambda: len(ready_pids(s, "gateway")) == 3 and victim not in ready_pids(s, "gateway"), 60,
                   what="a replacement gateway")
        wait_until(lambda: len([r for r in results if r[0] > killed_at + 0.5]) >= 20, 60, what="more load")
        stop.set()
        t.join()
        after = [code for when, code in results if when > killed_at + 0.2]
        assert after and all(code == 200 for code in after), after
        # the dead gateway's live-gauge files are gone, so /metrics no longer counts its in-flight work
        metrics_dir = os.path.join(status(s)["run_dir"], "metrics")
        assert not [f for f in os.listdir(metrics_dir) if f.startswith("gauge_live") and f.endswith(f"_{victim}.db")]
        assert [f for f in os.listdir(metrics_dir) if f.startswith("gauge_live")]  # the live gateways' files remain
    finally:
        s.stop()


def _is_engine(p: psutil.Process) -> bool:
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return False
    return "engine_worker" in cmd or "zserve: engine" in cmd


def test_crash_looping_tier_is_backed_off_reported_and_fatal(tmp_path):
    # An engine that keeps dying (killed here the moment it appears) is restarted with back-off,
    # reported as crash-looping, and finally fatal: the supervisor stops with exit 1. (The first back-off is
    # ZSERVE_RESTART_BACKOFF's 0.1 s here rather than the default 0.5 s: the same doubling, in a fifth of the time.)
    log = tmp_path / "launch.log"
    t0 = time.monotonic()
    with open(log, "wb") as err_file:
        proc = subprocess.Popen([*LAUNCH, "api-server", "--port", "0", *TINY], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=err_file, env={**os.environ, "ZSERVE_RESTART_BACKOFF": "0.1"})
        killed: set[int] = set()

        def kill_new_engines() -> bool:
            try:
                kids = psutil.Process(proc.pid).children()
            except psutil.NoSuchProcess:
                kids = []
            for child in kids:
                if child.pid not in killed and _is_engine(child):
                    killed.add(child.pid)
                    child.kill()
            return proc.poll() is not None

        try:
            wait_until(kill_new_engines, 150, interval=0.02, what="the supervisor to give up on the engine tier")
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    elapsed = time.monotonic() - t0
    err = log.read_text(errors="replace")
    assert proc.returncode == 1, err[-3000:]
    assert "crash-looping" in err and "cannot run" in err
    delays = [line.rsplit("restarting it in ", 1)[1] for line in err.splitlines() if "restarting it in" in line]
    # 5 failures with doubling back-off (0.1 + 0.2 + 0.4 + 0.8 s) — not a tight loop
    assert delays[:4] == ["0.1s", "0.2s", "0.4s", "0.8s"] and len(delays) <= 8, err[-3000:]
    assert elapsed > 1.5 and len(killed) >= 5


def test_a_model_that_does_not_load_is_a_boot_error_that_stops_at_once(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    r = subprocess.run([*LAUNCH, "api-server", "--port", "0", "--model", str(bad)], cwd=ROOT, capture_output=True,
                       timeout=90)
    err = r.stderr.decode()
    assert r.returncode == 1, err
    assert "error: engine 0 cannot start" in err and "GGUF version 0 is not supported" in err, err
    assert not [line for line in err.splitlines() if "restarting it in" in line and "engine 0" in line], err


def test_kv_cache_too_small_for_one_request_is_a_boot_error_that_stops_at_once():
    # A configuration that can never start must not be restarted (each restart reloads the weights).
    r = subprocess.run([*LAUNCH, "api-server", "--port", "0", *TINY, "--kv-cache-memory", "1KB"], cwd=ROOT,
                       capture_output=True, timeout=90)
    err = r.stderr.decode()
    assert r.returncode == 1, err
    assert "error: engine 0 cannot start" in err and "KV cache holds" in err and "not restarting" in err, err
    assert "restarting it in" not in err and "crash-looping" not in err, err
    assert err.count("init: 20/20") == 1 and "engine 0 ready" not in err, err  # the weights were loaded once


def test_hung_gateway_is_killed_and_replaced():
    s = Server("--count", "2", "--heartbeat-timeout", "2", *TINY, log_name="hung")
    try:
        victim = ready_pids(s, "gateway")[0]
        os.kill(victim, signal.SIGSTOP)
        wait_until(lambda: not psutil.pid_exists(victim) or psutil.Process(victim).status() == psutil.STATUS_ZOMBIE,
                   15, what="the hung gateway to be killed")
        wait_until(lambda: len(ready_pids(s, "gateway")) == 2, 30, what="a replacement gateway")
        # A stopped process is continued after the SIGABRT, so it writes where it was at once instead of dying
        # of the SIGKILL that follows ABORT_GRACE later, silent.
        assert "sent no heartbeat" in s.tail(20000) and "Fatal Python error: Aborted" in s.tail(20000)
        assert all(complete(s.url).status_code == 200 for _ in range(5))
    finally:
        s.stop()


def test_scaling_both_tiers_while_serving_fails_no_request():
    s = Server("--count", "2", *TINY, log_name="scale")
    try:
        results: list[int] = []
        stop = threading.Event()

        def load():
            while not stop.is_set():
                with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as c:
                    try:
                        with c.stream("POST", s.url + "/v1/completions", json=stream_body(40)) as r:
                            body = "".join(r.iter_lines())
                            results.append(r.status_code if '"error"' not in body and "[DONE]" in body else -1)
                    except httpx.HTTPError:
                        results.append(-2)

        clients = [threading.Thread(target=load) for _ in range(3)]
        for c in clients:
            c.start()
        steps = [("api-server", 3), ("api-server", 1), ("engine", 2), ("engine", 1), ("api-server", 2)]
        counts = []
        for tier, n in steps:
            before = len(results)
            r = subprocess.run([*LAUNCH, "scale", tier, str(n), "--port", str(s.port)], cwd=ROOT, capture_output=True,
                               timeout=120)
            assert r.returncode == 0, r.stderr
            wait_until(lambda before=before: len(results) >= before + 5, 60, what="requests during the scaling step")
            counts.append(len(results) - before)
        stop.set()
        for c in clients:
            c.join(timeout=60)
        assert len(results) > 25
        assert [x for x in results if x != 200] == [], results
        st = status(s)
        assert st["desired"] == {"gateway": 2, "engine": 1}
        assert len(ready_pids(s, "gateway")) == 2 and len(ready_pids(s, "engine")) == 1
        # the drained engine 1 left no socket file behind
        sockets = sorted(f for f in os.listdir(st["run_dir"]) if f.endswith(".sock"))
        assert sockets == ["control.sock", *engine_sockets(0)]
    finally:
        s.stop()


@pytest.mark.parametrize("timeout, code", [("30", 0), ("0", 1)])
def test_sigterm_drains_in_flight_requests(timeout, code):
    s = Server("--count", "2", "--shutdown-timeout", timeout, *TINY, log_name=f"sigterm-{timeout}")
    results = [StreamResult() for _ in range(3)]
    threads = [threading.Thread(target=run_stream, args=(s.url, stream_body(400), r)) for r in results]
    for t in threads:
        t.start()
    wait_until(lambda: all(r.chunks > 2 for r in results), 30, what="streams to flow")
    s.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=60)
    assert s.proc.wait(60) == code
    if code == 0:
        assert all(r.finish == "length" and r.error is None and r.done for r in results)
    else:
        assert all(r.error and "shutting down" in r.error["message"] and r.done for r in results)
    s.stop()


def test_a_connection_accepted_before_its_gateway_drains_is_answered_not_reset():
    """A client that connected just before its gateway stopped listening (a rolling restart, SIGTERM) sends its
    request while the gateway drains: it gets an answer. The drain used to end at once with no request in flight
    and close the connection, so the client saw a reset (a rolling-restart test's "Connection error")."""
    s = Server("--count", "1", *TINY, log_name="drain-accepted")
    try:
        (gateway_pid,) = ready_pids(s, "gateway")
        with socket.create_connection(("127.0.0.1", s.port), timeout=30) as sock:
            mine = sock.getsockname()

            def accepted() -> bool:
                conns = psutil.Process(gateway_pid).net_connections("tcp")
                return any(c.raddr and (c.raddr.ip, c.raddr.port) == mine for c in conns)

            wait_until(accepted, 10, what="the gateway to accept the connection")
            s.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: "gateway 0 draining" in s.tail(1 << 20), 10, what="the gateway to drain")
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: zserve\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert s.proc.wait(60) == 0
    finally:
        s.stop()


def test_pause_through_one_gateway_is_seen_by_every_gateway(tiny_server):
    url = tiny_server.url

    def views() -> dict[int, dict]:
        seen: dict[int, dict] = {}
        for _ in range(200):
            with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as c:
                st = c.get(url + "/status").json()
            seen[st["gateway"]] = st
            if len(seen) == 2:
                return seen
        raise AssertionError(f"reached only gateways {sorted(seen)}")

    r = httpx.post(url + "/pause")
    assert r.status_code == 200 and r.json()["paused"] is True
    try:
        # the supervisor answered only once every gateway applied it: no waiting needed
        assert all(v["paused"] for v in views().values())
        blocked = complete(url)
        assert blocked.status_code == 503 and blocked.json()["error"]["code"] == "server_paused"
        assert "Retry-After" in blocked.headers
    finally:
        assert httpx.post(url + "/resume").status_code == 200
    seen = views()
    assert not any(v["paused"] for v in seen.values())
    assert len({v["cluster_version"] for v in seen.values()}) == 1
    assert complete(url).status_code == 200


def test_metrics_aggregate_every_gateway_and_the_engines(tiny_server):
    for _ in range(6):
        assert complete(tiny_server.url).status_code == 200

    def scrape() -> tuple[str, dict[str, float]] | None:
        text = httpx.get(tiny_server.url + "/metrics").text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        ok = samples.get('zserve_http_requests_total{method="POST",route="/v1/completions",status="200"}', 0)
        # counted across both gateway processes, whichever served each request (the other gateway's numbers
        # arrive with its next metrics flush, gateway/metrics.py)
        return (text, samples) if ok >= 6 and samples.get("zserve_time_to_first_token_seconds_count", 0) >= 6 else None

    text, samples = wait_until(scrape, 10, what="both gateways' request metrics")
    assert samples['zserve_engine_up{engine="0",model="tiny-random"}'] == 1.0
    assert 'zserve_engine_requests_running{engine="0",model="tiny-random"}' in samples
    assert "zserve_inter_token_latency_seconds_bucket" in text


def test_launch_status_prints_every_process(tiny_server):
    out = subprocess.run([*LAUNCH, "status", "--port", str(tiny_server.port)], cwd=ROOT, capture_output=True,
                         timeout=30, check=True).stdout.decode()
    lines = [ln for ln in out.splitlines() if ln.startswith(("engine", "gateway"))]
    assert len(lines) == 3 and all(" ready " in ln for ln in lines)
    assert "running" in out and "in-flight" in out
    # --json prints the reply the tests' status() helper reads in process
    shown = orjson.loads(subprocess.run([*LAUNCH, "status", "--port", str(tiny_server.port), "--json"], cwd=ROOT,
                                        capture_output=True, timeout=30, check=True).stdout)
    asked = status(tiny_server)
    assert [(p["tier"], p["pid"], p["state"]) for p in shown["processes"]] == \
        [(p["tier"], p["pid"], p["state"]) for p in asked["processes"]]
    assert shown["desired"] == asked["desired"] and shown["models"] == asked["models"]


def test_second_sigint_stops_at_once_without_draining():
    s = Server("--count", "2", "--shutdown-timeout", "60", *TINY, log_name="sigint-twice")
    kids = s.descendants()
    result = StreamResult()
    t = threading.Thread(target=run_stream, args=(s.url, stream_body(4000), result))
    t.start()
    wait_until(lambda: result.chunks > 2, 30, what="a stream to flow")
    s.proc.send_signal(signal.SIGINT)
    wait_until(lambda: "draining" in s.tail(20000), 10, what="the first SIGINT to start a drain")
    started = time.monotonic()
    s.proc.send_signal(signal.SIGINT)
    assert s.proc.wait(15) == 1  # the in-flight stream was cut off
    assert time.monotonic() - started < 10  # far less than the 60 s drain it skipped
    wait_until(lambda: not [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE], 5,
               what="children to exit")
    t.join(30)
    assert result.finish != "length" and result.error
    s.stop()


# The real `launch` with one change: its reconcile loop raises once the file named by $ZSERVE_FAULT_FILE exists
# (a bug of the supervisor's own, injected from outside: production code has no hook for it).
_FAULTY_LAUNCH = """
import os, sys
from launch import supervisor
from launch.cli import main
trigger, reconcile = os.environ["ZSERVE_FAULT_FILE"], supervisor.Supervisor.reconcile
def reconcile_or_fail(self):
    if os.path.exists(trigger):
        raise RuntimeError("injected supervisor fault")
    reconcile(self)
supervisor.Supervisor.reconcile = reconcile_or_fail
sys.argv[0] = "launch"
main()
"""


def test_an_unexpected_error_in_the_supervisor_stops_every_child_cleanly_and_exits_non_zero(tmp_path):
    trigger = tmp_path / "fail-now"
    s = Server(command=[sys.executable, "-c", _FAULTY_LAUNCH, "api-server", "--port", "0", "--count", "2", *TINY],
               env={"ZSERVE_FAULT_FILE": str(trigger)}, log_name="supervisor-fault")
    try:
        kids = {p["pid"]: f"{p['tier']} {p['index']}" for p in status(s)["processes"]}
        assert len(kids) == 3 and complete(s.url).status_code == 200
        trigger.touch()
        code = s.proc.wait(60)
    finally:
        s.stop()
    log = s.log_path.read_text(errors="replace")
    assert code == EXIT_SUPERVISOR_FAILED, log[-3000:]
    assert "the supervisor failed; stopping every process" in log
    assert "Traceback" in log and "RuntimeError: injected supervisor fault" in log
    assert f"stopped (exit code {EXIT_SUPERVISOR_FAILED})" in log
    for pid, name in kids.items():  # each drained and exited on its own (not killed with the supervisor)
        assert f"{name} (pid {pid}) exited with code 0" in log, log[-3000:]
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
