"""The supervisor's pipe events and control commands are typed, versioned lines; malformed ones are refused."""

from __future__ import annotations

import orjson
import pytest

from protocol import ProtocolError
from protocol.cluster import SCALING_PHASES, ClusterState, EngineInfo
from protocol.control import (
    COMMANDS,
    CONTROL_VERSION,
    DEFAULT_DRAIN_TIMEOUT,
    ELASTIC_OUTCOMES,
    PIPE_COMMANDS,
    PIPE_EVENTS,
    REGISTRY_REPLIES,
    REPLIES,
    Ack,
    BootFailed,
    ClusterUpdate,
    ElasticScaleCommand,
    ElasticScaleReply,
    EngineRegistry,
    ErrorReply,
    GroupCommand,
    GroupFreeze,
    GroupReport,
    Heartbeat,
    LineBuffer,
    PauseCommand,
    PauseReply,
    ProcessStatus,
    Ready,
    ReloadCommand,
    ReloadReply,
    ResumeCommand,
    ScaleCommand,
    ScaleReply,
    StatusCommand,
    StatusReply,
    StopCommand,
    StopReply,
    decode_line,
    encode_line,
)
from protocol.holds import Hold

STATE = ClusterState(version=7, holds=(Hold("paused", since=1.5e9), Hold("reloading", "tiny-random", 1.6e9)),
                     engines=(EngineInfo(0, "ipc:///tmp/e0.sock", "ready", 123, "tiny-random"),),
                     gateways_desired=2, engines_desired=1, models={"tiny-random": 1})

ROUND_TRIPS = [
    (Ready(index=0, endpoint="ipc:///tmp/e0.sock", device="cpu", dtype="float32"), PIPE_EVENTS),
    (Ready(index=1), PIPE_EVENTS),
    (Heartbeat(running=2, waiting=1, kv_used=0.25), PIPE_EVENTS),
    (Heartbeat(in_flight=3, draining=True), PIPE_EVENTS),
    (Ack(7), PIPE_EVENTS),
    (BootFailed("engine 0: the KV cache holds 1 blocks"), PIPE_EVENTS),
    (ClusterUpdate(STATE), PIPE_COMMANDS),
    (StatusCommand(), COMMANDS),
    (ScaleCommand("api-server", 3), COMMANDS),
    (PauseCommand(), COMMANDS),
    (ResumeCommand(), COMMANDS),
    (StopCommand(), COMMANDS),
    (ErrorReply("bad command"), REPLIES),
    (ScaleReply("engine", 2), REPLIES),
    (ScaleCommand("engine", 2, "all-MiniLM-L6-v2"), COMMANDS),
    (ScaleReply("engine", 2, "all-MiniLM-L6-v2"), REPLIES),
    (PauseReply(True, 7, unacknowledged=("gateway 1",)), REPLIES),
    (StopReply(), REPLIES),
    (ClusterUpdate(ClusterState(version=8, scaling="draining", holds=(Hold("resizing", "moe", 2.0, "draining"),))),
     PIPE_COMMANDS),
    (PauseCommand("tiny-random"), COMMANDS),
    (ResumeCommand("tiny-random"), COMMANDS),
    (PauseReply(True, 8, model="tiny-random"), REPLIES),
    (EngineRegistry(3, models={"tiny-random": 1}, holds=(Hold("reloading", "tiny-random", 2.0),)), REGISTRY_REPLIES),
    (ElasticScaleCommand(4), COMMANDS),
    (ReloadCommand(), COMMANDS),
    (ReloadReply(5, 12.5), REPLIES),
    (GroupCommand(3, 2, 1, "/run/x/ep-0-3.store", ("ipc:///run/x/e0.sock", "ipc:///run/x/e1.sock"), "gloo", 1),
     PIPE_COMMANDS),
    (GroupFreeze(3), PIPE_COMMANDS),
    (GroupFreeze(3, frozen=False), PIPE_COMMANDS),
    (GroupReport(3, "formed", experts=(0, 4)), PIPE_EVENTS),
    (GroupReport(3, "frozen"), PIPE_EVENTS),
    (GroupReport(3, "lost", reason="peer closed"), PIPE_EVENTS),
    (ClusterUpdate(ClusterState(version=9, holds=(Hold("failed", "tiny-random", 3.0, "engine 0: exit code 1"),))),
     PIPE_COMMANDS),
    (ElasticScaleCommand(2, drain_timeout=30.5, model="tiny-random"), COMMANDS),
    (ElasticScaleReply("ok", "Scaled to 4 data parallel engines", 4, pause_s=1.25), REPLIES),
    (ElasticScaleReply("drain_timeout", "in-flight requests did not finish within 30s", 2), REPLIES),
    (StatusReply(url="http://127.0.0.1:8000", models={"tiny-random": 1}, pid=42, run_dir="/run/x", uptime_s=1.5,
                 desired={"engine": 1, "gateway": 2}, paused=False, cluster_version=3,
                 processes=(ProcessStatus("engine", 0, 99, "ready", 0, False, uptime_s=1.0, running=1, waiting=0,
                                          kv_used=0.5, draining=False, model="tiny-random"),
                            ProcessStatus("gateway", 1, None, "backoff", 2, True, last_exit="exit code 1",
                                          next_start_in_s=0.5)),
                 holds=(Hold("paused", "tiny-random", 1.5e9),)), REPLIES),
]


@pytest.mark.parametrize("msg,allowed", ROUND_TRIPS, ids=lambda v: type(v).__name__ if not isinstance(v, tuple) else "")
def test_every_control_message_round_trips_as_one_json_line(msg, allowed):
    line = encode_line(msg)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    head = orjson.loads(line)
    assert head["v"] == CONTROL_VERSION and head["t"] == msg.TYPE
    assert decode_line(line.rstrip(b"\n"), allowed) == msg


def test_status_keeps_the_shape_operators_read():
    reply = ROUND_TRIPS[-1][0]
    wire = reply.to_wire()
    backoff = wire["processes"][1]
    assert backoff["pid"] is None and "running" not in backoff  # pid stays, absent load fields are left off
    assert wire["processes"][0]["running"] == 1 and wire["desired"] == {"engine": 1, "gateway": 2}


def _line(**body) -> bytes:
    return orjson.dumps({"v": CONTROL_VERSION, **body})


@pytest.mark.parametrize("line,allowed,why", [
    (b"not json", COMMANDS, "not JSON"),
    (b"[1, 2]", COMMANDS, "JSON object"),
    (orjson.dumps({"cmd": "status"}), COMMANDS, "version"),  # the old untyped dicts
    (orjson.dumps({"v": 99, "t": "status"}), COMMANDS, "version"),
    (_line(t="reboot"), COMMANDS, "unexpected message type"),
    (_line(t="ack", version=1), COMMANDS, "unexpected message type"),  # a pipe event on the control socket
    (_line(t="status", extra=1), COMMANDS, "unknown fields"),
    (_line(t="scale", tier="database", count=2), COMMANDS, "scale needs tier"),
    (_line(t="scale", tier="engine", count=0), COMMANDS, "scale needs tier"),
    (_line(t="scale", tier="engine", count=True), COMMANDS, "scale needs tier"),
    (_line(t="scale", tier="engine"), COMMANDS, "bad scale message"),
    (_line(t="heartbeat", running=-1), PIPE_EVENTS, "running out of range"),
    (_line(t="heartbeat", kv_used=1.5), PIPE_EVENTS, "kv_used out of range"),
    (_line(t="heartbeat", draining="yes"), PIPE_EVENTS, "draining must be a bool"),
    (_line(t="ack", version="7"), PIPE_EVENTS, "version out of range"),
    (_line(t="ready"), PIPE_EVENTS, "bad ready message"),
    (_line(t="boot_failed", reason=""), PIPE_EVENTS, "reason"),
    (_line(t="cluster", state={"version": 1, "holds": "no"}), PIPE_COMMANDS, "holds"),
    (_line(t="cluster", state={"version": 1, "holds": [{"reason": "tired"}]}), PIPE_COMMANDS, "hold reason"),
    (_line(t="cluster", state={"version": 1, "holds": [{"reason": "paused", "model": ""}]}), PIPE_COMMANDS, "model"),
    (_line(t="pause", model=""), COMMANDS, "model"),
    (_line(t="cluster", state={"version": 1, "engines": [{"rank": 0}]}), PIPE_COMMANDS, "bad cluster"),
    (_line(t="cluster", state={"version": 1,
                               "engines": [{"rank": 0, "endpoint": "x", "state": "on fire", "pid": 1}]}),
     PIPE_COMMANDS, "not a valid EngineState"),
    (_line(t="cluster", state={"version": 1,
                               "engines": [{"rank": -1, "endpoint": "x", "state": "ready", "pid": 1}]}),
     PIPE_COMMANDS, "bad engine entry"),
    (_line(t="pause_reply", paused=True, version=1, unacknowledged=[3]), REPLIES, "unacknowledged"),
    (_line(t="cluster", state={"version": 1, "scaling": "resharding"}), PIPE_COMMANDS, "scaling"),
    (_line(t="scale_elastic_ep", size=0), COMMANDS, "size"),
    (_line(t="scale_elastic_ep", size=257), COMMANDS, "size"),
    (_line(t="scale_elastic_ep", size=True), COMMANDS, "size"),
    (_line(t="scale_elastic_ep", size="4"), COMMANDS, "size"),
    (_line(t="scale_elastic_ep", size=4, drain_timeout=0), COMMANDS, "drain_timeout"),
    (_line(t="scale_elastic_ep", size=4, drain_timeout=86401), COMMANDS, "drain_timeout"),
    (_line(t="scale_elastic_ep", size=4, drain_timeout="60"), COMMANDS, "drain_timeout"),
    (_line(t="scale_elastic_ep", size=4, model=""), COMMANDS, "model"),
    (_line(t="scale_elastic_ep_reply", outcome="ok", message="m", size=4), COMMANDS, "unexpected message type"),
    (_line(t="scale_elastic_ep_reply", outcome="maybe", message="m", size=4), REPLIES, "outcome"),
    (_line(t="scale_elastic_ep_reply", outcome="ok", message=3, size=4), REPLIES, "message or size"),
    (_line(t="scale_elastic_ep_reply", outcome="ok", message="m", size=4, pause_s="1"), REPLIES, "pause_s"),
    (_line(t="status_reply", url="", model="m", pid=1, run_dir="", uptime_s=0, desired={}, paused=False,
           cluster_version=0, processes=[{"tier": "engine"}]), REPLIES, "bad status_reply message"),
])
def test_malformed_control_lines_are_refused_with_a_reason(line, allowed, why):
    with pytest.raises(ProtocolError, match=why):
        decode_line(line, allowed)


def test_messages_are_validated_when_built_too():
    with pytest.raises(ProtocolError):
        ScaleCommand("engine", 257)
    with pytest.raises(ProtocolError):
        Heartbeat(in_flight=-3)


def test_elastic_messages_are_validated_when_built_too():
    assert ElasticScaleCommand(4).drain_timeout == DEFAULT_DRAIN_TIMEOUT and ElasticScaleCommand(4).model is None
    with pytest.raises(ProtocolError, match="size"):
        ElasticScaleCommand(0)
    with pytest.raises(ProtocolError, match="drain_timeout"):
        ElasticScaleCommand(2, drain_timeout=-1)
    with pytest.raises(ProtocolError, match="outcome"):
        ElasticScaleReply("done", "", 2)
    assert set(ELASTIC_OUTCOMES.values()) == {200, 400, 408, 409, 500}


@pytest.mark.parametrize("phase", SCALING_PHASES)
def test_cluster_state_carries_every_scaling_phase(phase):
    state = ClusterState(version=3, scaling=phase, holds=(Hold("resizing", "moe", 1.0, phase),) if phase else ())
    assert ClusterState.from_json(state.to_json()) == state


def test_cluster_state_refuses_an_unknown_scaling_phase():
    for bad in ("resharding", None, 1):
        with pytest.raises(ValueError, match="scaling"):
            ClusterState.from_json({"version": 1, "scaling": bad})
    assert ClusterState.from_json({"version": 1}).scaling == ""  # a state from before elastic EP


def test_line_buffer_splits_lines_and_refuses_an_endless_one():
    buf = LineBuffer(limit=16)
    assert buf.feed(b'{"a":1}\n{"b"') == [b'{"a":1}']
    assert buf.feed(b":2}\n") == [b'{"b":2}']
    with pytest.raises(ProtocolError, match="limit"):
        buf.feed(b"x" * 17)
    assert buf.feed(b"ok\n") == [b"ok"]  # the reader recovers after dropping the runaway line
