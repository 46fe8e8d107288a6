"""The supervisor's control socket: a Unix socket only its owner can open.

One command line in, one reply line out: the typed messages of ``protocol.control``
(``StatusCommand``, ``ScaleCommand``, ``PauseCommand``, ``ResumeCommand``, ``StopCommand``).
`launch scale`, `launch status` and `launch stop` use it, and so do gateways for cluster-wide
operations. The supervisor's side is ``launch.control_server``.

Only the owner: the socket lives in a 0700 directory, is itself 0600, and every connection's
peer uid (SO_PEERCRED) must be the supervisor's.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import struct
import tempfile

from protocol.control import REPLIES, ControlMessage, decode_line, encode_line

MAX_LINE = 1 << 16  # a command; replies may be longer


def runtime_base() -> str:
    """Per-user directory that holds every server's run directory and control-socket pointer."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = os.path.join(base, "zserve") if base else os.path.join(tempfile.gettempdir(), f"zserve-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def pointer_path(where: int | str) -> str:
    """Where the supervisor serving TCP port ``where`` (or the Unix socket at path ``where``) records its
    control socket's path."""
    if isinstance(where, str):
        digest = hashlib.sha256(os.path.abspath(where).encode()).hexdigest()[:16]
        return os.path.join(runtime_base(), f"uds-{digest}.ctl")
    return os.path.join(runtime_base(), f"port-{where}.ctl")


def find_control_socket(where: int | str) -> str:
    try:
        with open(pointer_path(where)) as f:
            return f.read().strip()
    except FileNotFoundError:
        what = f"on the Unix socket {where}" if isinstance(where, str) else f"on port {where}"
        raise ConnectionError(f"no zserve server is running {what} (no {pointer_path(where)})") from None


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
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()


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
