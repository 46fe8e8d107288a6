"""A hung child is aborted with SIGABRT first, so faulthandler writes where it hangs, then killed."""

from __future__ import annotations

import selectors
import signal
import time
from functools import partial

from launch.children import spawn
from launch.supervisor import ServeConfig, Supervisor
from zserve.catalog import resolve
from zserve.config import ModelSpec


def test_hung_child_leaves_a_faulthandler_traceback_in_the_log_before_it_is_killed(capfd):
    sup = Supervisor(ServeConfig(models=[(resolve("tiny-random"), ModelSpec("tiny-random"))], heartbeat_timeout=0.5))
    arbiter = sup.arbiter
    child = spawn(arbiter.slot("gateway", 0), "tests.unit.hang_child", [])  # the supervisor's own spawn
    arbiter.sel.register(child.status_fd, selectors.EVENT_READ, partial(arbiter.read_status, child))
    arbiter.children.append(child)
    try:
        deadline = time.monotonic() + 30
        while child.alive and time.monotonic() < deadline:
            arbiter.poll(0.1)
            arbiter.check_hung(time.monotonic())
        assert child.ready and not child.alive, "the hung child was not ended within 30 s"
        assert child.killed_hung and child.proc.returncode == -signal.SIGABRT  # it died of the abort, not SIGKILL
    finally:
        child.signal(signal.SIGKILL)
        child.proc.wait()
        child.close_pipes()
    err = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in err
    assert "hang_child.py" in err and "in block_the_loop" in err  # the traceback says where it hung
