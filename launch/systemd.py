"""systemd integration: sd_notify (READY, STOPPING, WATCHDOG, STATUS) and socket activation."""

from __future__ import annotations

import os
import socket

SD_LISTEN_FDS_START = 3


def notify(message: str) -> bool:
    """Send one sd_notify message when NOTIFY_SOCKET is set; False otherwise."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(message.encode())
        return True
    except OSError:
        return False


def watchdog_interval() -> float | None:
    """Half of WATCHDOG_USEC in seconds (systemd's advice), when the watchdog is on for us."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6


def inherited_listener() -> socket.socket | None:
    """The first socket passed by systemd socket activation (LISTEN_FDS), if any."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    n = int(os.environ.get("LISTEN_FDS", "0"))
    if n < 1:
        return None
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    sock.set_inheritable(True)
    for k in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(k, None)  # children must not think the sockets are theirs
    return sock
