"""Finding a running server's control socket (zserve.control) from another shell, and the no-cache warning.

A server under deploy/systemd's units records its control socket in /run/zserve (the unit's XDG_RUNTIME_DIR),
not in the admin's own runtime directory: `sudo launch status` must find it there, root must be let in, and
anyone else must be told to use sudo rather than that no server runs.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

import pytest
from click.testing import CliRunner

from launch.cli import main
from tests.unit.as_user import FailedAs, can_switch_user, run_as
from zserve import control, paths


@pytest.fixture
def dirs(monkeypatch):
    """A caller's runtime directory and a system unit's, both reachable by other users (unlike tmp_path)."""
    base = tempfile.mkdtemp()
    os.chmod(base, 0o755)
    user, system = os.path.join(base, "user"), os.path.join(base, "system")
    os.makedirs(os.path.join(system, "zserve"))
    os.makedirs(user, mode=0o777)
    os.chmod(user, 0o777)
    monkeypatch.setenv("XDG_RUNTIME_DIR", user)
    monkeypatch.setattr(control, "SYSTEM_RUNTIME_DIR", system)
    yield base, user, system
    shutil.rmtree(base)


def serve_pointer(system: str, port: int) -> str:
    """A system unit's pointer for ``port`` to a control socket of this process's user."""
    sock = os.path.join(system, "zserve", "control.sock")
    control.listen(sock).close()
    with open(os.path.join(system, "zserve", f"port-{port}.ctl"), "w") as f:
        f.write(sock)
    return sock


def test_a_system_units_server_is_found_when_the_callers_own_dir_has_none(dirs):
    _, _, system = dirs
    sock = serve_pointer(system, 8123)
    assert control.find_control_socket(8123) == sock
    with pytest.raises(ConnectionError, match=r"no zserve server is running on port 8124 \(no .*user.* nor .*system"):
        control.find_control_socket(8124)


def test_the_callers_own_server_comes_first(dirs):
    _, user, system = dirs
    serve_pointer(system, 8123)
    mine = os.path.join(user, "zserve", "port-8123.ctl")
    os.makedirs(os.path.dirname(mine), exist_ok=True)
    with open(mine, "w") as f:
        f.write("/own/control.sock")
    assert control.find_control_socket(8123) == "/own/control.sock"


@pytest.mark.skipif(not can_switch_user(), reason="needs root, to look as another user (nobody)")
def test_another_user_is_told_whose_server_it_is_not_that_none_runs(dirs):
    _, _, system = dirs
    serve_pointer(system, 8123)  # owned by root
    with pytest.raises(FailedAs, match="the zserve server on port 8123 runs as user root: only root and root") as e:
        run_as("nobody", lambda: control.find_control_socket(8123))
    assert e.value.kind == "NotPermitted"
    os.chmod(system, 0o700)  # the unit's RuntimeDirectoryMode: the pointer itself cannot be read
    with pytest.raises(FailedAs, match=r"belongs to user root: only root and root may control a server on port 8123"):
        run_as("nobody", lambda: control.find_control_socket(8123))


def test_the_cli_names_the_command_to_run_instead(monkeypatch):
    def refuse(where):
        raise control.NotPermitted(f"the zserve server on port {where} runs as user zserve", "zserve")

    monkeypatch.setattr(control, "find_control_socket", refuse)
    argv = ["status", "--port", "8123"]
    monkeypatch.setattr("sys.argv", ["/opt/zserve/.venv/bin/launch", *argv])
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 1
    assert r.output.rstrip().endswith("runs as user zserve; run: sudo /opt/zserve/.venv/bin/launch status --port 8123")


def test_the_control_socket_lets_in_its_owner_and_root_and_no_one_else(monkeypatch, tmp_path):
    a, b = socket.socketpair()  # the peer is this process
    with a, b:
        assert control.peer_is_owner(a)
        if os.geteuid() == 0:  # a server of another user (zserve) lets this root process in
            monkeypatch.setattr(control.os, "getuid", lambda: 12345)
            assert control.peer_is_owner(a)
            monkeypatch.undo()
    if not can_switch_user():
        return
    base = tempfile.mkdtemp()
    try:
        os.chmod(base, 0o755)
        path = os.path.join(base, "control.sock")
        server = control.listen(path)
        os.chmod(path, 0o666)  # the mode is one guard; this tests the other (SO_PEERCRED)

        def connect() -> None:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)

        with server:
            run_as("nobody", connect)
            conn, _ = server.accept()
            with conn:
                assert not control.peer_is_owner(conn)
    finally:
        shutil.rmtree(base)


def test_no_cache_directory_is_warned_about_with_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert paths.no_cache_warning() is None
    blocked = tmp_path / "file"
    blocked.write_text("")  # a cache home that cannot hold a directory, whoever runs this (root too)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    warning = paths.no_cache_warning()
    assert paths.user_cache_dir() is None
    assert warning.startswith(f"no cache: {blocked}/zserve cannot be written")
    assert "CacheDirectory=zserve" in warning and "XDG_CACHE_HOME" in warning
