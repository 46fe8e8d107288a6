"""The listening socket, created once by the supervisor and inherited by every gateway."""

from __future__ import annotations

import errno
import socket


class ListenError(RuntimeError):
    pass


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def create_listener(host: str, port: int, backlog: int = 2048) -> socket.socket:
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


def _explain(e: OSError, host: str, port: int) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"--port {port}: address {host}:{port} is already in use"
    if e.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine"
    if e.errno == errno.EACCES:
        return f"--port {port}: permission denied (ports below 1024 need privileges)"
    return f"cannot listen on {host}:{port}: {e.strerror}"
