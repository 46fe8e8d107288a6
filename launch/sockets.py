"""The listening socket, created once by the supervisor and inherited by every gateway."""

from __future__ import annotations

import errno
import http.client
import os
import socket
import stat

from protocol.constants import LISTEN_BACKLOG


class ListenError(RuntimeError):
    pass


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def create_listener(host: str, port: int, backlog: int = LISTEN_BACKLOG) -> socket.socket:
    """Bind ``host:port`` with SO_REUSEADDR + SO_REUSEPORT and listen; the fd is inheritable.

    SO_REUSEPORT would silently let a second server share a port that is already serving, so the
    port is first probed without it: "address in use" then fails fast instead of splitting traffic.
    """
    fam = _family(host)
    if port != 0:
        probe = socket.socket(fam, socket.SOCK_STREAM)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise ListenError(_explain(e, host, port)) from None
        finally:
            probe.close()
    sock = socket.socket(fam, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise ListenError(_explain(e, host, port)) from None
    sock.set_inheritable(True)
    return sock


def create_unix_listener(path: str, backlog: int = LISTEN_BACKLOG) -> socket.socket:
    """Bind a Unix socket at ``path``, mode 0660 (its owner and group: a proxy on the same host, such as nginx,
    joins the group), and listen; the fd is inheritable, so every gateway serves it as they serve a port. A
    stale socket file (nobody accepts on it) is replaced; one a live server holds is refused."""
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ListenError(f"--uds {path}: the path exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            raise ListenError(f"--uds {path}: a server is already listening there")
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117)  # never a moment with wider permissions than 0660
    try:
        sock.bind(path)
        os.chmod(path, 0o660)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise ListenError(f"cannot listen on the Unix socket {path}: {e.strerror}") from None
    finally:
        os.umask(old)
    sock.set_inheritable(True)
    return sock


class UnixHTTPConnection(http.client.HTTPConnection):
    """``http.client`` over a Unix socket (the supervisor's own health check of a ``--uds`` server)."""

    def __init__(self, path: str, timeout: float = 5.0):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


def _explain(e: OSError, host: str, port: int) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"--port {port}: address {host}:{port} is already in use"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine"
    if e.errno == errno.EACCES:
        return f"--port {port}: permission denied (ports below 1024 need privileges)"
    return f"cannot listen on {host}:{port}: {e.strerror}"
