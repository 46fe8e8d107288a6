"""The supervisor's control socket: a Unix socket only its owner can open.

One command line in, one reply line out: the typed messages of ``protocol.control``
(``StatusCommand``, ``ScaleCommand``, ``PauseCommand``, ``ResumeCommand``, ``StopCommand``, the LoRA loads...).
`launch scale`, `launch status` and `launch stop` use it, and so do gateways for cluster-wide
operations. The supervisor's side is ``launch.control_server``.

Only the owner: the socket lives in a 0700 directory, is itself 0600, and every connection's
peer uid (SO_PEERCRED) must be the supervisor's, or root's (who could become that user anyway).

A server is found by its port (or ``--uds`` path) through a pointer file in the caller's runtime
directory, then in the one deploy/systemd's units give their service user (``/run/zserve``): so
``sudo launch status --port 8000`` on a host that runs zserve under systemd finds the unit's server.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import pwd
import socket
import struct
import tempfile

from protocol.control import REPLIES, ControlMessage, decode_line, encode_line

MAX_LINE = 1 << 16  # a command; replies may be longer


# The XDG_RUNTIME_DIR of deploy/systemd's units (RuntimeDirectory=zserve): where a system service's server
# records its control socket, looked at when the caller's own runtime directory has no pointer.
SYSTEM_RUNTIME_DIR = "/run/zserve"


class NotPermitted(ConnectionError):
    """The server (or the directory that would name it) belongs to another user: only that user and root may
    control it. ``user`` is that user's name."""

    def __init__(self, message: str, user: str):
        super().__init__(message)
        self.user = user


def _base_in(runtime_dir: str | None) -> str:
    if runtime_dir:
        return os.path.join(runtime_dir, "zserve")
    return os.path.join(tempfile.gettempdir(), f"zserve-{os.getuid()}")


def runtime_base() -> str:
    """Per-user directory that holds every server's run directory and control-socket pointer (created)."""
    path = _base_in(os.environ.get("XDG_RUNTIME_DIR"))
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def _pointer_name(where: int | str) -> str:
    if isinstance(where, str):
        return f"uds-{hashlib.sha256(os.path.abspath(where).encode()).hexdigest()[:16]}.ctl"
    return f"port-{where}.ctl"


def pointer_path(where: int | str) -> str:
    """Where the supervisor serving TCP port ``where`` (or the Unix socket at path ``where``) records its
    control socket's path."""
    return os.path.join(runtime_base(), _pointer_name(where))


def _user_of(path: str) -> str:
    try:
        uid = os.stat(path).st_uid
    except OSError:
        return "another user"
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def find_control_socket(where: int | str) -> str:
    """The control socket of the server on ``where``: the caller's own server, else a system service's.
    Raises NotPermitted for a server the caller may not control, ConnectionError when there is none."""
    what = f"on the Unix socket {where}" if isinstance(where, str) else f"on port {where}"
    mine = pointer_path(where)
    system = os.path.join(_base_in(SYSTEM_RUNTIME_DIR), _pointer_name(where))
    for pointer in dict.fromkeys((mine, system)):
        try:
            with open(pointer) as f:
                path = f.read().strip()
        except FileNotFoundError:
            continue
        except PermissionError:  # a system service's runtime directory, searchable by its user and root only
            user = _user_of(SYSTEM_RUNTIME_DIR)
            raise NotPermitted(f"{SYSTEM_RUNTIME_DIR}, where a zserve system service records its servers, belongs "
                               f"to user {user}: only {user} and root may control a server {what}", user) from None
        try:
            owner = os.stat(path).st_uid
        except OSError:
            return path  # gone or unreadable: connecting says which
        if os.geteuid() not in (owner, 0):
            user = _user_of(path)
            raise NotPermitted(f"the zserve server {what} runs as user {user}: only {user} and root may control "
                               "it", user)
        return path
    raise ConnectionError(f"no zserve server is running {what} (no {mine}"
                          + (f" nor {system})" if system != mine else ")"))


def listen(path: str) -> socket.socket:
    if os.path.exists(path):
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        s.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    s.listen(64)
    s.setblocking(False)
    return s


def peer_is_owner(conn: socket.socket) -> bool:
    """The peer runs as this process's user, or as root: root can become any user, so refusing it would only
    make an operator type `sudo -u zserve` (a system unit's server answers `sudo launch status` this way)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid in (os.getuid(), 0)


def request(path: str, cmd: ControlMessage, timeout: float = 30.0) -> ControlMessage:
    """Send one command and wait for its reply (blocking; for the CLI). Raises ProtocolError for a bad reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        s.sendall(encode_line(cmd))
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(MAX_LINE)
            if not chunk:
                break
            buf += chunk
    if not buf:
        raise ConnectionError("the supervisor closed the control connection without answering")
    return decode_line(buf.rstrip(b"\n"), REPLIES)


async def request_async(path: str, cmd: ControlMessage, timeout: float = 30.0) -> ControlMessage:
    """The same from an event loop (gateways forwarding pause/resume)."""
    reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path, limit=1 << 20), timeout)
    try:
        writer.write(encode_line(cmd))
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
    finally:
        writer.close()
    if not line:
        raise ConnectionError("the supervisor closed the control connection without answering")
    return decode_line(line.rstrip(b"\n"), REPLIES)
