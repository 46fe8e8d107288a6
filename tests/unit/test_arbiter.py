"""The arbiter (``launch/supervisor/arbiter.py``), the process loop with nothing of cluster policy: it starts each
tier's processes up to the desired count, drains the ones past it, turns signals into actions in the loop, and
marks a model failed when every engine of it crash-loops — stopping the server only when every model failed, the
gateways did, or ``--exit-on-crash-loop`` says so."""

from __future__ import annotations

import os
import signal

import pytest

from launch.children import CRASH_LOOP_FAILURES
from launch.supervisor import Arbiter, TierFailed
from launch.supervisor.arbiter import ArbiterHooks
from launch.tiers import ServeConfig, model_tiers
from tests.unit.fakes import FakeChild
from zserve.catalog import ModelSource
from zserve.config import ModelSpec


def _source(name: str) -> ModelSource:
    return ModelSource(name, "hf", "/nowhere", "/nowhere")


@pytest.fixture
def arbiter():
    cfg = ServeConfig(models=[(_source("chat"), ModelSpec("chat", engines=1)),
                              (_source("embed"), ModelSpec("embed", engines=1))], gateways=1)
    started: list[FakeChild] = []
    reloads: list[int] = []
    pipes: list[int] = []

    def start(slot) -> FakeChild:
        r, w = os.pipe()
        pipes.extend((r, w))
        child = FakeChild(slot.index, tier=slot.tier, status_fd=r, slot=slot)
        started.append(child)
        return child

    a = Arbiter(cfg, model_tiers(cfg), ArbiterHooks(start=start, reload=lambda: reloads.append(1)))
    a.started, a.reloads = started, reloads  # type: ignore[attr-defined]
    yield a
    for fd in pipes:
        os.close(fd)


def _crash_loop(a: Arbiter, tier: str, index: int, now: float) -> None:
    slot = a.slot(tier, index)
    for k in range(CRASH_LOOP_FAILURES):
        slot.record_failure(now - k, "exit code 1")
    for c in a.live(tier):
        if c.index == index:
            c.alive, c.ready = False, False
    a.children = [c for c in a.children if c.alive]


def test_each_tier_is_started_up_to_its_desired_count_and_drained_past_it(arbiter):
    arbiter.turn(0.0)
    assert sorted((c.tier, c.index) for c in arbiter.started) == [("engine", 0), ("engine", 64), ("gateway", 0)]
    arbiter.scale("gateway", 2)
    arbiter.turn(1.0)
    assert [(c.tier, c.index) for c in arbiter.live("gateway")] == [("gateway", 0), ("gateway", 1)]
    arbiter.scale("gateway", 1)
    arbiter.turn(2.0)
    gone = next(c for c in arbiter.live("gateway") if c.index == 1)
    assert gone.draining and gone.signals == [signal.SIGTERM]


def test_a_child_dead_since_the_turns_reap_is_replaced_only_once_reaped(arbiter):
    """A child that dies between the turn's reap and its count (SIGKILLed right after it was started) keeps its
    slot until it is reaped, when its failure is recorded and its backoff set. It was replaced at once: two
    engines 0 ran, their two deaths counted for one restart, and a tier was called crash-looping after four."""
    arbiter.turn(0.0)
    first = next(c for c in arbiter.started if (c.tier, c.index) == ("engine", 0))
    first.alive = False  # dead, not reaped yet
    arbiter._match_counts(0.0)
    assert [c for c in arbiter.started if (c.tier, c.index) == ("engine", 0)] == [first]


def test_signals_are_handled_in_the_loop(arbiter):
    arbiter.on_signal(signal.SIGTTIN)
    arbiter.on_signal(signal.SIGHUP)
    arbiter.poll(0.5)
    assert arbiter.desired["gateway"] == 2 and arbiter.reloads == [1] and not arbiter.stopping
    arbiter.on_signal(signal.SIGTERM)
    arbiter.poll(0.5)
    assert arbiter.stopping


def test_a_crash_looping_model_fails_alone_and_serves_again_once_an_engine_is_ready(arbiter):
    arbiter.turn(100.0)
    for c in arbiter.children:
        c.ready = True
    _crash_loop(arbiter, "engine", 64, 100.0)
    arbiter.turn(100.0)  # embed failed: chat and the gateways serve on
    assert list(arbiter.failed) == ["embed"] and "exit code 1" in arbiter.failed["embed"]
    arbiter.turn(200.0)  # the slot tries again after its backoff
    replacement = next(c for c in arbiter.live("engine") if c.index == 64)
    replacement.ready = True
    arbiter.turn(200.0)
    assert arbiter.failed == {}


def test_the_server_stops_once_every_model_failed(arbiter):
    arbiter.turn(100.0)
    _crash_loop(arbiter, "engine", 64, 100.0)
    arbiter.turn(100.0)
    _crash_loop(arbiter, "engine", 0, 100.0)
    with pytest.raises(TierFailed, match="chat's engine tier cannot run: every engine is crash-looping"):
        arbiter.turn(100.0)


def test_exit_on_crash_loop_stops_at_the_first_failed_model(arbiter):
    arbiter.cfg.exit_on_crash_loop = True
    arbiter.turn(100.0)
    _crash_loop(arbiter, "engine", 64, 100.0)
    with pytest.raises(TierFailed, match="embed's engine tier cannot run"):
        arbiter.turn(100.0)


def test_a_crash_looping_gateway_tier_stops_the_server(arbiter):
    arbiter.turn(100.0)
    _crash_loop(arbiter, "gateway", 0, 100.0)
    with pytest.raises(TierFailed, match="the gateway tier cannot run"):
        arbiter.turn(100.0)


def test_an_engine_hosts_engines_publish_kv_events_on_ports_no_engine_ever_takes(arbiter):
    """On one host, ipc beside the engine's socket; on an engine host, two TCP ports a rank after every port the
    models' engines could take (64 ranks each), or from --kv-events-port on."""
    arbiter.run_dir = "/run/x"
    assert arbiter.kv_events_endpoint(64) == "ipc:///run/x/engine-64-kv.sock"
    arbiter.cfg.bind = "tcp://0.0.0.0:7100"  # (two models: ranks 0..127, engine ports 7101..7228)
    engines = {arbiter.engine_endpoint(r) for r in range(128)}
    kv = [arbiter.kv_events_endpoint(r) for r in range(128)]
    assert kv[0] == "tcp://0.0.0.0:7229" and kv[64] == "tcp://0.0.0.0:7357"
    ports = {int(e.rsplit(":", 1)[1]) + k for e in kv for k in (0, 1)}  # each PUB and its replay
    assert len(ports) == 256 and not ports & ({int(e.rsplit(":", 1)[1]) for e in engines} | {7100})
    arbiter.cfg.kv_events_port = 9000
    assert arbiter.kv_events_endpoint(1) == "tcp://0.0.0.0:9002"


@pytest.mark.parametrize("value, first", [(None, 0.5), ("0.1", 0.1), ("30", 30.0)])
def test_the_restart_back_off_starts_at_its_setting_and_doubles_up_to_its_cap(monkeypatch, value, first):
    from launch.children import BACKOFF_MAX, Slot

    if value is None:
        monkeypatch.delenv("ZSERVE_RESTART_BACKOFF", raising=False)
    else:
        monkeypatch.setenv("ZSERVE_RESTART_BACKOFF", value)
    slot = Slot("engine", 0)
    delays = [slot.record_failure(100.0 + i, "exit code -9") for i in range(CRASH_LOOP_FAILURES)]
    assert delays == [min(BACKOFF_MAX, first * 2 ** i) for i in range(CRASH_LOOP_FAILURES)]


@pytest.mark.parametrize("value", ["0", "-1", "nan", "31", "fast"])
def test_a_restart_back_off_that_is_no_number_of_seconds_is_refused(monkeypatch, value):
    from launch.children import restart_backoff

    monkeypatch.setenv("ZSERVE_RESTART_BACKOFF", value)
    with pytest.raises(ValueError, match="ZSERVE_RESTART_BACKOFF.*at most 30"):
        restart_backoff()


def test_launch_refuses_a_bad_restart_back_off_before_anything_starts():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "launch", "api-server", "--model", "tiny-random", "--port", "0"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "ZSERVE_RESTART_BACKOFF": "0"})
    assert r.returncode == 2 and "ZSERVE_RESTART_BACKOFF='0'" in r.stderr and "at most 30" in r.stderr, r.stderr
