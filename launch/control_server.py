"""The supervisor's side of its owner-only control socket (``zserve.control`` is the client side).

Each connection carries one command line and gets one reply line (``protocol.control``). The
server only does the socket work — accept, check the peer is the owner, read, decode, reply — and
hands each decoded command to a ``dispatch`` function (the supervisor's ``Commands``). A command whose effect
every gateway must apply first (pause, resume) is answered later: ``dispatch`` returns
``AwaitAcks`` and ``answer_pending`` replies once no ready gateway lags behind that cluster-state
version, or after a few seconds naming the gateways that did not acknowledge it. A command that takes
as long as it takes (an elastic resize) returns ``Later``, answered when its ``reply`` is set.

Everything is non-blocking and driven by the supervisor's selector: each registered file object
carries the callback that handles it.
"""

from __future__ import annotations

import logging
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

from protocol import ProtocolError
from protocol.control import COMMANDS, ControlMessage, ErrorReply, PauseReply, decode_line, encode_line
from zserve import control

log = logging.getLogger("zserve.launch")

ACK_TIMEOUT = 5.0  # seconds a pause/resume reply waits for every gateway's acknowledgement


@dataclass(frozen=True)
class AwaitAcks:
    """Answer with ``reply`` once every ready gateway has applied cluster-state ``version``."""

    version: int
    reply: PauseReply


@dataclass
class Later:
    """A reply that is not known yet (an elastic resize, a rolling restart): the server sends ``reply`` once the
    operation sets it (through ``convert``, when the command expects another reply type)."""

    reply: ControlMessage | None = None
    convert: Callable[[ControlMessage], ControlMessage] | None = None

    def set(self, reply: ControlMessage) -> None:
        self.reply = self.convert(reply) if self.convert is not None else reply


Dispatch = Callable[[ControlMessage], "ControlMessage | AwaitAcks | Later"]


@dataclass
class _Pending:
    conn: socket.socket
    version: int
    deadline: float
    reply: PauseReply


class ControlServer:
    def __init__(self, path: str, sel: selectors.BaseSelector, dispatch: Dispatch):
        self.path = path
        self.sel = sel
        self.dispatch = dispatch
        self.sock = control.listen(path)
        self.sel.register(self.sock, selectors.EVENT_READ, self._accept)
        self._bufs: dict[socket.socket, bytes] = {}
        self.pending: list[_Pending] = []
        self.later: list[tuple[socket.socket, Later]] = []

    def _accept(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return
        if not control.peer_is_owner(conn):
            log.warning("refused a control connection from another user")
            conn.close()
            return
        conn.setblocking(False)
        self._bufs[conn] = b""
        self.sel.register(conn, selectors.EVENT_READ, partial(self._read, conn))

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(control.MAX_LINE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        buf = self._bufs[conn] + data
        if b"\n" not in buf:
            if len(buf) > control.MAX_LINE:
                self._reply(conn, ErrorReply("command too long"))
            else:
                self._bufs[conn] = buf
            return
        self.sel.unregister(conn)
        try:
            cmd = decode_line(buf.split(b"\n", 1)[0], COMMANDS)
        except ProtocolError as e:
            log.warning("dropped a malformed control command: %s", e)
            self._reply(conn, ErrorReply(f"bad command: {e}"))
            return
        answer = self.dispatch(cmd)
        if isinstance(answer, AwaitAcks):
            self.pending.append(_Pending(conn, answer.version, time.monotonic() + ACK_TIMEOUT, answer.reply))
        elif isinstance(answer, Later):
            self.later.append((conn, answer))
        else:
            self._reply(conn, answer)

    def answer_pending(self, lagging: Callable[[int], list[str]]) -> None:
        """Reply to the deferred commands whose version every gateway applied (``lagging`` names the others)."""
        now = time.monotonic()
        still = []
        for p in self.pending:
            behind = lagging(p.version)
            if not behind:
                self._reply(p.conn, p.reply)
            elif now > p.deadline:
                self._reply(p.conn, replace(p.reply, unacknowledged=tuple(behind)))
            else:
                still.append(p)
        self.pending = still
        if self.later:
            for conn, later in [item for item in self.later if item[1].reply is not None]:
                self._reply(conn, later.reply)  # type: ignore[arg-type]
            self.later = [item for item in self.later if item[1].reply is None]

    def _reply(self, conn: socket.socket, msg: ControlMessage) -> None:
        try:
            conn.setblocking(True)
            conn.settimeout(2)
            conn.sendall(encode_line(msg))
        except OSError:
            pass
        self._bufs.pop(conn, None)
        conn.close()

    def _close(self, conn: socket.socket) -> None:
        self._bufs.pop(conn, None)
        try:
            self.sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def close(self) -> None:
        for conn in list(self._bufs):
            self._close(conn)
        for p in self.pending:
            p.conn.close()
        for conn, _ in self.later:
            conn.close()
        self.pending, self.later = [], []
        try:
            self.sel.unregister(self.sock)
        except (KeyError, ValueError):
            pass
        self.sock.close()
