"""Process plumbing shared by every zserve child: titles, parent-death signals, logging."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from protocol.constants import EXIT_BOOT_ERROR
from protocol.control import BootFailed, ControlMessage, encode_line

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


def exit_now(code: int = 0) -> None:
    """End a child process that has finished its work without the interpreter's teardown: the log and standard
    streams are flushed, and nothing else is left to do (its sockets were closed with their linger), while tearing
    torch's modules down takes half a second on a CPU engine, which every drain (shutdown, scale-down, rolling
    restart) would wait for."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


class StatusPipe:
    """A child's line-based channel to the supervisor: one typed message per line (``protocol.control``:
    Ready, then Heartbeats and Acks).

    A pipe rather than a socket: it needs no address, closes by itself when either side dies, and
    the supervisor sees EOF the moment a child exits.
    """

    def __init__(self, fd: int | None):
        self.fd = fd
        # Threads share it (the heartbeat thread, the step loop): a line longer than PIPE_BUF is not written
        # atomically, so one line at a time.
        self._lock = threading.Lock()

    def send(self, msg: ControlMessage) -> None:
        if self.fd is None:
            return
        try:
            with self._lock:
                os.write(self.fd, encode_line(msg))
        except OSError:
            pass  # the supervisor is gone; PDEATHSIG ends us shortly


BOOT_ERRORS = (ValueError, NotImplementedError)
"""What a start-up check raises for a configuration that can never work (sizes, limits, unsupported
features): retrying cannot help, unlike a crash or an out-of-memory error."""


@contextmanager
def boot_phase(status: StatusPipe, what: str) -> Iterator[None]:
    """Turn a start-up misconfiguration into a boot error: log it, tell the supervisor why, and exit
    with EXIT_BOOT_ERROR so it stops at once instead of restarting a process that cannot start."""
    try:
        yield
    except BOOT_ERRORS as e:
        logging.getLogger("zserve").error("%s cannot start: %s (a configuration error; restarting will not help)",
                                          what, e)
        status.send(BootFailed(str(e)[:4096] or type(e).__name__))
        sys.exit(EXIT_BOOT_ERROR)


def redact_url(value: str) -> str:
    """A URL's password replaced (``redis://:secret@host`` → ``redis://:***@host``); other text as it is."""
    from urllib.parse import urlsplit, urlunsplit

    if "://" not in value:
        return value
    parts = urlsplit(value)
    if parts.password is None:
        return value
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


SECRET_OPTIONS = frozenset({"api_keys", "admin_keys"})
"""Options whose values never reach a log or an answer: shown as how many were given."""


def redact_option(name: str, value: Any) -> Any:
    """An option's value as a log line or ``/server_info`` may show it: keys (``SECRET_OPTIONS``) as how many were
    given, a URL's password masked (``redact_url``: a Redis state URL's), inside lists and mappings too. CURVE keys
    never are option values (options name their directory), so a directory is shown as it is."""
    if name in SECRET_OPTIONS:
        return f"<{len(value) if isinstance(value, (list, tuple)) else 1} redacted>"
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, dict):
        return {k: redact_option(k, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_option(name, v) for v in value]
    return value
