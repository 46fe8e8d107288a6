"""CURVE key files (zserve.curve) and the engine registry's messages (protocol.control)."""

from __future__ import annotations

import os
import shutil
import time

import click
import pytest
import zmq.auth

from launch.cli import _check_kv_events_ports
from launch.hosts.engine_registry import (
    RemoteEngines,
    engine_endpoint,
    engine_ports,
    kv_events_endpoint,
    kv_events_ports,
)
from protocol import ProtocolError
from protocol.cluster import EngineInfo
from protocol.control import (
    REGISTRY_REPLIES,
    REGISTRY_REQUESTS,
    EngineRegistry,
    RegistryHello,
    decode_line,
    encode_line,
)
from protocol.holds import Hold
from protocol.kv_events import replay_endpoint
from zserve.curve import CurveKeys, KeyFileError, write_keys


def test_written_keys_load_for_each_side(tmp_path):
    d = str(tmp_path / "k")
    write_keys(d)
    server, client = CurveKeys.for_server(d), CurveKeys.for_client(d)
    assert server.server_public == client.server_public and server.server_secret
    assert client.client_public in server.authorized
    assert client.pair_for_connecting() == (client.client_public, client.client_secret)
    # The engine host connects (expert-parallel members waking each other) with its own pair.
    assert CurveKeys.for_server(d).pair_for_connecting() == (server.server_public, server.server_secret)
    assert {oct(os.stat(os.path.join(root, f)).st_mode & 0o777) for root, _, files in os.walk(d) for f in files} == {
        "0o600"}


def test_missing_or_wrong_key_files_say_which_and_how_to_make_them(tmp_path):
    with pytest.raises(KeyFileError, match="server.key_secret is missing.*launch keys"):
        CurveKeys.for_server(str(tmp_path))
    d = str(tmp_path / "c")
    write_keys(d, client_only=True)
    with pytest.raises(KeyFileError, match="server.key is missing"):
        CurveKeys.for_client(d)
    (tmp_path / "c" / "server.key").write_text("not a certificate\n")
    with pytest.raises(KeyFileError, match="not a CURVE certificate|holds no"):
        CurveKeys.for_client(d)
    full = str(tmp_path / "full")
    write_keys(full)
    os.unlink(os.path.join(full, "authorized", "client.key"))
    with pytest.raises(KeyFileError, match="holds no client key"):
        CurveKeys.for_server(full)


def test_a_key_added_to_authorized_counts_after_a_rescan(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_keys(a)
    write_keys(b, client_only=True)
    keys = CurveKeys.for_server(a)
    public, _ = zmq.auth.load_certificate(os.path.join(b, "client.key"))
    assert public not in keys.authorized
    shutil.copy(os.path.join(b, "client.key"), os.path.join(a, "authorized", "b.key"))
    keys.rescan()
    assert public in keys.authorized


def test_registry_messages_round_trip_and_refuse_bad_lines():
    reg = EngineRegistry(3, (EngineInfo(0, "tcp://0.0.0.0:7101", "ready", 42, "tiny-random"),), {"tiny-random": 1},
                         (Hold("reloading", "tiny-random", 1.7e9),))
    assert decode_line(encode_line(reg), REGISTRY_REPLIES) == reg
    hello = RegistryHello("gw-host", applied=3)
    assert decode_line(encode_line(hello), REGISTRY_REQUESTS) == hello
    for line in (b'{"v":2,"t":"engine_registry","version":1,"engines":[{"rank":0}]}',
                 b'{"v":2,"t":"engine_registry","version":-1}',
                 b'{"v":2,"t":"engine_registry","version":1,"engines":[{"rank":0,"endpoint":"x","state":"odd"}]}',
                 b'{"v":2,"t":"engine_registry","version":1,"extra":1}', b"\xff", b"[]",
                 b'{"v":2,"t":"engine_registry","version":1,"holds":[{"reason":"melting"}]}'):
        with pytest.raises(ProtocolError):
            decode_line(line, REGISTRY_REPLIES)
    with pytest.raises(ProtocolError):  # a reply is not a request
        decode_line(encode_line(reg), REGISTRY_REQUESTS)


def test_engine_ports_follow_the_registry_and_wildcards_become_the_registry_host():
    assert engine_endpoint("tcp://10.0.0.5:7100", 0) == "tcp://10.0.0.5:7101"
    assert engine_endpoint("tcp://[::1]:7100", 3) == "tcp://[::1]:7104"
    remote = RemoteEngines("tcp://10.1.2.3:7100", None, 1.0, 30.0)
    try:
        assert remote._reachable("tcp://0.0.0.0:7101") == "tcp://10.1.2.3:7101"
        assert remote._reachable("tcp://10.9.9.9:7101") == "tcp://10.9.9.9:7101"
        assert remote.engines(0.0) == ()  # it never answered
    finally:
        remote.close()
    v6 = RemoteEngines("tcp://[fd00::1]:7100", None, 1.0, 30.0)
    try:
        assert v6._reachable("tcp://[::]:7102") == "tcp://[fd00::1]:7102"
    finally:
        v6.close()


def test_kv_event_ports_come_two_a_rank_after_every_engine_port_a_model_could_take():
    bind = "tcp://0.0.0.0:7100"
    assert engine_ports(bind, 1) == range(7101, 7165)  # ranks 0..63, however the tier scales
    kv = kv_events_ports(bind, 1)
    assert kv == range(7165, 7293)
    assert kv_events_endpoint(bind, kv.start, 0) == "tcp://0.0.0.0:7165"
    assert replay_endpoint(kv_events_endpoint(bind, kv.start, 0)) == "tcp://0.0.0.0:7166"
    last = kv_events_endpoint(bind, kv.start, 63)
    assert last == "tcp://0.0.0.0:7291" and replay_endpoint(last) == f"tcp://0.0.0.0:{kv.stop - 1}"
    # Two models: ranks 0..127, so the KV ports move past them; an explicit first port is taken as given.
    assert kv_events_ports(bind, 2) == range(7229, 7229 + 256)
    assert kv_events_ports(bind, 1, 9000) == range(9000, 9128)


def test_kv_event_ports_that_meet_the_engines_or_run_past_65535_are_refused():
    _check_kv_events_ports("tcp://127.0.0.1:7100", 1, None)
    _check_kv_events_ports("tcp://127.0.0.1:7100", 1, 9000)
    _check_kv_events_ports("tcp://127.0.0.1:7100", 1, 7100 - 128)  # just below the registry
    for first in (7100, 7164, 7100 - 127):
        with pytest.raises(click.BadParameter, match="meet the registry's and engines' ports"):
            _check_kv_events_ports("tcp://127.0.0.1:7100", 1, first)
    with pytest.raises(click.BadParameter, match="run past 65535"):
        _check_kv_events_ports("tcp://127.0.0.1:65400", 1, None)
    with pytest.raises(click.BadParameter, match="run past 65535"):
        _check_kv_events_ports("tcp://127.0.0.1:7100", 1, 65500)


def test_a_gateway_host_reaches_the_kv_events_of_engines_bound_on_a_wildcard_address():
    remote = RemoteEngines("tcp://10.1.2.3:7100", None, 1.0, 30.0)
    try:
        remote.registry = EngineRegistry(1, (
            EngineInfo(0, "tcp://0.0.0.0:7101", "ready", kv_events="tcp://0.0.0.0:7165"),
            EngineInfo(1, "tcp://10.9.9.9:7102", "ready", kv_events="tcp://10.9.9.9:7167"),
            EngineInfo(2, "tcp://0.0.0.0:7103", "ready")))
        remote.heard = time.monotonic()
        engines = remote.engines(time.monotonic())
        assert [(e.endpoint, e.kv_events) for e in engines] == [
            ("tcp://10.1.2.3:7101", "tcp://10.1.2.3:7165"), ("tcp://10.9.9.9:7102", "tcp://10.9.9.9:7167"),
            ("tcp://10.1.2.3:7103", "")]
    finally:
        remote.close()


# -- a key per gateway host (launch keys --name) and keys another user cannot read ----------------------------
def test_a_second_hosts_named_key_goes_beside_the_first(tmp_path):
    first, second = str(tmp_path / "k"), str(tmp_path / "gw-2")
    write_keys(first, name="gw-1")
    written = write_keys(second, client_only=True, name="gw-2")
    assert sorted(os.path.relpath(p, second) for p in written) == ["authorized/gw-2.key", "client.key",
                                                                    "client.key_secret"]
    shutil.copy(os.path.join(second, "authorized", "gw-2.key"), os.path.join(first, "authorized"))
    server = CurveKeys.for_server(first)
    gw1 = zmq.auth.load_certificate(os.path.join(first, "client.key_secret"))[0]
    gw2 = zmq.auth.load_certificate(os.path.join(second, "client.key_secret"))[0]
    assert {gw1, gw2} == server.authorized and gw1 != gw2
    with pytest.raises(FileExistsError, match="never overwritten"):
        write_keys(first, client_only=True, name="gw-3")  # client.key is there
    with pytest.raises(ValueError, match="not a key name"):
        write_keys(str(tmp_path / "x"), name="../gw")


def test_launch_keys_client_only_needs_a_name_and_never_overwrites(tmp_path):
    from click.testing import CliRunner

    from launch.cli import main

    d = str(tmp_path / "gw-2")
    r = CliRunner().invoke(main, ["keys", "--dir", d, "--client-only"])
    assert r.exit_code == 2 and "--client-only needs --name" in r.output and not os.path.exists(d)
    r = CliRunner().invoke(main, ["keys", "--dir", d, "--client-only", "--name", "gw-2"])
    assert r.exit_code == 0 and os.path.join(d, "authorized", "gw-2.key") in r.output
    before = open(os.path.join(d, "client.key_secret"), "rb").read()
    r = CliRunner().invoke(main, ["keys", "--dir", d, "--client-only", "--name", "gw-2"])
    assert r.exit_code == 1 and "never overwritten" in r.output
    assert open(os.path.join(d, "client.key_secret"), "rb").read() == before


def test_a_key_this_user_cannot_read_is_not_reported_missing(tmp_path):
    """A key directory of another user (copied there as root, no chown) says who cannot read it, not "missing"
    (os.path.exists is False behind a directory this user may not search)."""
    import tempfile

    from tests.unit.as_user import FailedAs, can_switch_user, run_as

    if not can_switch_user():
        d = str(tmp_path / "k")
        write_keys(d)
        os.chmod(d, 0)
        try:
            with pytest.raises(KeyFileError, match="server.key is not readable by user .*chown -R"):
                CurveKeys.for_client(d)
        finally:
            os.chmod(d, 0o700)
        return
    base = tempfile.mkdtemp()  # tmp_path's parents are root's 0700 directories: nobody could not reach any key
    try:
        os.chmod(base, 0o755)
        d = os.path.join(base, "k")
        write_keys(d)  # 0700, owned by root
        with pytest.raises(FailedAs, match=r"server.key is not readable by user nobody\b.*chown -R nobody: "):
            run_as("nobody", lambda: CurveKeys.for_client(d) and None)
        os.chmod(d, 0o755)
        os.chmod(os.path.join(d, "server.key_secret"), 0o644)
        with pytest.raises(FailedAs, match="authorized is not readable by user nobody"):
            run_as("nobody", lambda: CurveKeys.for_server(d) and None)  # not "holds no client key"
    finally:
        shutil.rmtree(base)
