"""Rolling restarts: SIGHUP (systemd's ExecReload) replaces every gateway and engine one at a time while requests
stream, and none of them fails. `launch reload`, and a model whose only engine is replaced (its requests are held
meanwhile): tests/e2e/test_holds_per_model.py."""

from __future__ import annotations

import os
import signal

import pytest

from tests.helpers import Server, Traffic, status, wait_until

pytestmark = pytest.mark.slow


def pids(server: Server) -> dict[tuple[str, int], int]:
    return {(p["tier"], p["index"]): p["pid"] for p in status(server)["processes"] if p["state"] == "ready"}


def test_a_rolling_restart_under_streaming_load_fails_no_request_and_replaces_every_process():
    """Two engines: the model never stops serving."""
    s = Server("--model", "tiny-random", "--count", "2", "--engines", "2", "--dtype", "float32",
               "--max-num-seqs", "16", log_name="reload")
    try:
        before = pids(s)
        assert len(before) == 4
        with Traffic(s.url, "tiny-random", workers=4, keepalive=False) as traffic:
            os.kill(s.proc.pid, signal.SIGHUP)  # the supervisor: reload, not stop

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
    finally:
        assert s.stop() == 0
