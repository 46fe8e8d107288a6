"""Process hygiene: no orphans after `kill -9` of the supervisor; the gateway never loads torch; children are forks
of the zygotes (launch.zygote) and still the supervisor's own."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess

import httpx
import psutil
import pytest

from protocol.constants import LISTEN_BACKLOG
from tests.helpers import LAUNCH, ROOT, Server, wait_until


def test_kill_9_of_the_supervisor_leaves_no_process_and_the_port_is_free():
    s = Server("--count", "2", "--model", "tiny-random", log_name="kill9")
    kids = s.descendants()
    assert len(kids) == 5  # 2 gateways + 1 engine, and a zygote for each tier
    titles = sorted(" ".join(k.cmdline()) for k in kids)
    assert any("zserve: engine 0" in t for t in titles) and any("zserve: gateway 1" in t for t in titles)
    assert any("zserve: preload engine_worker" in t for t in titles), titles
    port = s.port
    s.proc.kill()
    s.proc.wait()

    def all_gone():
        return not [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]

    wait_until(all_gone, 5, what="every child to die with the supervisor")
    # restarting on the very same port works at once
    again = Server("--model", "tiny-random", port=port, ready_timeout=60, log_name="kill9-again")
    try:
        assert again.url.endswith(f":{port}"), again.url
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        assert again.stop(timeout=30) == 0


def test_gateways_do_not_load_torch(tiny_server):
    gateways = [k for k in tiny_server.descendants() if "gateway" in " ".join(k.cmdline())]
    assert gateways
    for g in gateways:
        maps = open(f"/proc/{g.pid}/maps").read()
        assert "libtorch" not in maps, f"gateway {g.pid} loaded torch"


@pytest.mark.skipif(shutil.which("ss") is None, reason="ss (iproute2) is not installed")
def test_the_listening_socket_keeps_the_supervisors_backlog_once_gateways_serve(tiny_server):
    """aiohttp calls listen() again on the inherited socket; with its default (128) a burst of connections waits
    for SYN retries. The socket every gateway serves keeps the supervisor's backlog."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{tiny_server.port}"], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[:3] == ["LISTEN", "0", str(LISTEN_BACKLOG)], out


def test_sigterm_stops_everything_with_exit_0():
    s = Server("--count", "2", "--model", "tiny-random", log_name="sigterm", env={"ZSERVE_PRELOAD": "0"})
    kids = s.descendants()
    assert len(kids) == 3 and not [k for k in kids if "preload" in " ".join(k.cmdline())]  # (no zygote)
    assert s.stop(signal.SIGTERM) == 0
    wait_until(lambda: not [k for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE], 5,
               what="children to exit")


def test_invalid_arguments_fail_fast_naming_the_flag():
    for args, flag in [(["--count", "0"], "--count"), (["--port", "70000"], "--port"), (["--model", "nope"], "--model"),
                       (["--dtype", "int3"], "--dtype")]:
        r = subprocess.run([*LAUNCH, "api-server", *args], cwd=ROOT, capture_output=True, timeout=60)
        assert r.returncode == 2, (args, r.stderr)
        assert flag in r.stderr.decode(), r.stderr


def test_port_in_use_is_reported(tiny_server):
    r = subprocess.run([*LAUNCH, "api-server", "--model", "tiny-random", "--port", str(tiny_server.port)], cwd=ROOT,
                       capture_output=True, timeout=60)
    assert r.returncode != 0 and b"already in use" in r.stderr


def _mapped_at(pid: int, library: str) -> str | None:
    """Where ``library`` is mapped in ``pid`` (a fork keeps its parent's addresses; a fresh interpreter's are
    randomized)."""
    with open(f"/proc/{pid}/maps") as f:
        return next((line.split("-", 1)[0] for line in f if library in line), None)


def _titled(server: Server) -> dict[str, psutil.Process]:
    """The supervisor's live descendants by title (one that exits meanwhile is left out)."""
    found = {}
    for k in server.descendants():
        with contextlib.suppress(psutil.Error):
            if k.status() != psutil.STATUS_ZOMBIE:
                found[" ".join(k.cmdline()).strip()] = k
    return found


def test_children_are_forks_of_zygotes_that_imported_their_code_and_stay_the_supervisors_own():
    s = Server("--count", "2", "--model", "tiny-random", log_name="zygote",
               env={"ZSERVE_RESTART_BACKOFF": "0.1"})  # (four restarts: the back-off is not what this tests)
    try:
        kids = _titled(s)
        for title in ("zserve: engine 0", "zserve: gateway 0", "zserve: gateway 1", "zserve: preload gateway",
                      "zserve: preload engine_worker"):
            assert kids[title].ppid() == s.proc.pid, (title, kids)  # (reparented to the supervisor, a subreaper)
        zygote, engine = kids["zserve: preload engine_worker"], kids["zserve: engine 0"]
        torch_at = _mapped_at(zygote.pid, "libtorch_cpu")
        assert torch_at and _mapped_at(engine.pid, "libtorch_cpu") == torch_at
        assert _mapped_at(kids["zserve: gateway 1"].pid, "uvloop/loop") == _mapped_at(
            kids["zserve: preload gateway"].pid, "uvloop/loop") is not None

        def replaced(old: psutil.Process) -> psutil.Process | None:
            new = _titled(s).get("zserve: engine 0")
            return new if new is not None and new.pid != old.pid and new.ppid() == s.proc.pid else None

        def completes() -> None:
            r = httpx.post(f"{s.url}/v1/completions", json={"model": "tiny-random", "prompt": "hi", "max_tokens": 3},
                           timeout=30)
            assert r.status_code == 200, r.text

        def ready_times(n: int) -> bool:
            return s.tail(1_000_000).count("zserve.launch: engine 0 ready (pid") >= n

        engine.kill()  # the replacement is a fork again, and the supervisor read the killed one's exit code
        engine = wait_until(lambda: replaced(engine), 30, what="engine 0 forked again")
        assert _mapped_at(engine.pid, "libtorch_cpu") == torch_at
        wait_until(lambda: ready_times(2), 30, what="engine 0 ready again")
        assert "died (exit code -9)" in s.tail(1_000_000)
        completes()

        zygote.kill()  # a tier's children start as fresh interpreters while its new zygote imports
        wait_until(lambda: zygote.status() == psutil.STATUS_ZOMBIE, 10, what="the zygote to die")
        engine.kill()
        engine = wait_until(lambda: replaced(engine), 60, what="engine 0 started again without a zygote")
        assert _mapped_at(engine.pid, "libtorch_cpu") != torch_at
        wait_until(lambda: ready_times(3), 60, what="engine 0 ready a third time")
        completes()
        assert "the zygote of the engine_worker tier is gone" in s.tail(1_000_000)

        def new_zygote() -> psutil.Process | None:  # (titled so once its imports are done)
            z = _titled(s).get("zserve: preload engine_worker")
            return z if z is not None and z.pid != zygote.pid else None

        zygote = wait_until(new_zygote, 60, what="a new zygote that has imported torch")
        engine.kill()
        engine = wait_until(lambda: replaced(engine), 60, what="engine 0 forked from the new zygote")
        assert _mapped_at(engine.pid, "libtorch_cpu") == _mapped_at(zygote.pid, "libtorch_cpu") is not None
        wait_until(lambda: ready_times(4), 60, what="engine 0 ready a fourth time")
        completes()
    finally:
        assert s.stop() == 0
