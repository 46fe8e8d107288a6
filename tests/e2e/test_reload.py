"""Rolling restarts: SIGHUP (and `launch reload`) replace every gateway and engine one at a time while
requests stream, and none of them fails."""

from __future__ import annotations

import os
import signal
import subprocess
import threading

import pytest

from tests.helpers import LAUNCH, ROOT, Server, Traffic, status, wait_until

pytestmark = pytest.mark.slow


def pids(server: Server) -> dict[tuple[str, int], int]:
    return {(p["tier"], p["index"]): p["pid"] for p in status(server)["processes"] if p["state"] == "ready"}


@pytest.mark.parametrize("engines, how", [(1, "SIGHUP"), (2, "launch reload")])
def test_a_rolling_restart_under_streaming_load_fails_no_request_and_replaces_every_process(engines, how):
    """One engine: its requests are held while it is replaced. Two: the model never stops serving."""
    s = Server("--model", "tiny-random", "--count", "2", "--engines", str(engines), "--dtype", "float32",
               "--max-num-seqs", "16", log_name=f"reload-{engines}")
    try:
        before = pids(s)
        assert len(before) == 2 + engines
        answer: dict = {}
        with Traffic(s.url, "tiny-random", workers=4, keepalive=False) as traffic:
            if how == "SIGHUP":
                os.kill(s.proc.pid, signal.SIGHUP)  # the supervisor: reload, not stop
            else:
                cli = threading.Thread(target=lambda: answer.update(r=subprocess.run(
                    [*LAUNCH, "reload", "--port", str(s.port)], cwd=ROOT, capture_output=True, text=True,
                    timeout=300)))
                cli.start()

            def replaced() -> bool:
                now = pids(s)
                return (len(now) == len(before) and len(status(s)["processes"]) == len(before)
                        and all(now.get(k) not in (None, pid) for k, pid in before.items()))

            wait_until(replaced, 180, 0.2, "every process replaced")
            wait_until(lambda: "reload: done" in s.tail(1 << 20), 30, what="the reload to finish")
            served = traffic.ok
            wait_until(lambda: traffic.ok > served + 4, 60, what="traffic after the reload")
        assert not traffic.failed, traffic.failed[:5]
        assert s.proc.poll() is None  # a reload does not stop the server
        if how == "launch reload":
            cli.join(60)
            r = answer["r"]
            assert r.returncode == 0 and f"reloaded: {2 + engines} process(es) replaced" in r.stdout, r.stderr
    finally:
        assert s.stop() == 0
