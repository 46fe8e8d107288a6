"""Process plumbing shared by every zserve child: titles, parent-death signals, logging."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

import orjson

PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (even by ``kill -9``).

    Called first thing in every child so that no zserve process outlives the supervisor. If the
    parent already died before we got here, exit at once.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except OSError:
            pass
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


def set_title(title: str) -> None:
    """Show the process's role in ps/top, e.g. ``zserve: engine 0``."""
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:
        pass


def ignore_terminal_signals() -> None:
    """Children leave Ctrl-C to the supervisor, which decides how to stop them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def setup_logging(role: str) -> logging.Logger:
    level = os.environ.get("ZSERVE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s [{role} %(process)d] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    return logging.getLogger("zserve")


class StatusPipe:
    """A child's line-based channel to the supervisor: one JSON object per line (ready, later heartbeats).

    A pipe rather than a socket: it needs no address, closes by itself when either side dies, and
    the supervisor sees EOF the moment a child exits.
    """

    def __init__(self, fd: int | None):
        self.fd = fd

    def send(self, event: str, **fields) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, orjson.dumps({"event": event, **fields}) + b"\n")
        except OSError:
            pass  # the supervisor is gone; PDEATHSIG ends us shortly
