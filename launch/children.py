"""One supervised child process and the slot it fills.

A *slot* is a position in a tier (gateway 1, engine 0): it outlives the processes that fill it,
and remembers their failures so restarts back off and a crash loop is noticed. Each child has
two pipes: *status* (child → supervisor: ready, heartbeats, acks; EOF = the child is gone) and
*control* (supervisor → child: the cluster state), each carrying the typed lines of
``protocol.control``. Children run with ``faulthandler`` on, so the SIGABRT a hung child gets
before SIGKILL leaves every thread's traceback in the log.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from gateway.security import SECRET_ENV
from launch.zygote import ForkedChild, Zygote
from protocol.cluster import EngineState
from protocol.control import ControlMessage, EngineCondition, Heartbeat, LineBuffer, encode_line

_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None

CRASH_LOOP_FAILURES = 5
CRASH_LOOP_WINDOW = 60.0
BACKOFF_BASE = 0.5  # seconds before the first restart, unless ZSERVE_RESTART_BACKOFF says otherwise
BACKOFF_MAX = 30.0
RESTART_BACKOFF_ENV = "ZSERVE_RESTART_BACKOFF"


def restart_backoff() -> float:
    """Seconds before the first restart of a child that exited unexpectedly: ``ZSERVE_RESTART_BACKOFF`` or
    ``BACKOFF_BASE``. Each failure within ``CRASH_LOOP_WINDOW`` doubles it, up to ``BACKOFF_MAX``. ValueError for a
    value that is not a number of seconds in (0, BACKOFF_MAX] (``launch`` refuses to start with one)."""
    raw = os.environ.get(RESTART_BACKOFF_ENV, "").strip()
    if not raw:
        return BACKOFF_BASE
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= BACKOFF_MAX:
        raise ValueError(f"{RESTART_BACKOFF_ENV}={raw!r}: give the seconds before a first restart, more than 0 and "
                         f"at most {BACKOFF_MAX:g}")
    return value


def _child_setup() -> None:  # runs in the child between fork and exec
    if _libc is not None:
        _libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the supervisor


@dataclass
class Slot:
    tier: str
    index: int
    failures: deque = field(default_factory=deque)  # monotonic times of unexpected exits
    next_start: float = 0.0
    restarts: int = 0
    last_exit: str = ""
    model: str = ""  # an engine's model, named in messages when a server serves several

    @property
    def name(self) -> str:
        return f"{self.tier} {self.index}" + (f" of {self.model}" if self.model else "")

    def record_failure(self, now: float, why: str) -> float:
        """Note an unexpected exit; return the delay before the next start."""
        self.failures.append(now)
        while self.failures and now - self.failures[0] > CRASH_LOOP_WINDOW:
            self.failures.popleft()
        self.last_exit = why
        delay = min(BACKOFF_MAX, restart_backoff() * 2 ** (len(self.failures) - 1))
        self.next_start = now + delay
        return delay

    def crash_looping(self, now: float) -> bool:
        recent = [t for t in self.failures if now - t <= CRASH_LOOP_WINDOW]
        return len(recent) >= CRASH_LOOP_FAILURES


@dataclass
class Child:
    slot: Slot
    proc: subprocess.Popen | ForkedChild
    status_fd: int
    control_fd: int
    started: float = field(default_factory=time.monotonic)
    ready_at: float | None = None
    last_beat: float = field(default_factory=time.monotonic)
    draining: bool = False
    drain_started: float | None = None
    killed_hung: bool = False
    aborted_at: float | None = None  # when a hung child got SIGABRT (SIGKILL follows after a grace period)
    acked_version: int = -1
    load: Heartbeat | None = None  # the last heartbeat (load, in-flight)
    boot_error: str | None = None  # why it cannot start, from its BootFailed message
    # An engine's LoRA adapters (launch.ops.lora): what it last reported serving (None: nothing reported yet), the
    # adapters it was told to load or unload and has not answered for, and those it refused (name -> why).
    loras: tuple[str, ...] | None = None
    lora_sent: set[str] = field(default_factory=set)
    lora_failed: dict[str, str] = field(default_factory=dict)
    # An engine's condition (asleep, weight version: launch.ops.engine_ops), as it last reported it; whether it was
    # told to sleep with its model.
    condition: EngineCondition | None = None
    sleep_sent: bool = False
    lines: LineBuffer = field(default_factory=LineBuffer)

    @property
    def tier(self) -> str:
        return self.slot.tier

    @property
    def index(self) -> int:
        return self.slot.index

    @property
    def name(self) -> str:
        return self.slot.name

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def ready(self) -> bool:
        return self.ready_at is not None

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def state(self) -> EngineState:
        """Where the process is in its life, as gateways are told it (gateways and engines share the words).
        Never "exited": whether it still runs is ``alive``, asked separately, and a dead child leaves the
        cluster state only when it is reaped, so no membership can carry a state outside the contract."""
        if self.draining:
            return EngineState.DRAINING
        return EngineState.READY if self.ready else EngineState.STARTING

    def send(self, msg: ControlMessage) -> bool:
        """Write one control line; False if the child can no longer read it."""
        if self.control_fd < 0:
            return False
        try:
            os.write(self.control_fd, encode_line(msg))
            return True
        except (BlockingIOError, BrokenPipeError, OSError):
            return False

    def signal(self, sig: int) -> None:
        try:
            self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def close_pipes(self) -> None:
        for name in ("status_fd", "control_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
                setattr(self, name, -1)


def child_env(extra: dict | None = None) -> dict[str, str]:
    """The environment a child runs with: the supervisor's, less its secrets, and ``extra``."""
    return {**{k: v for k, v in os.environ.items() if k not in SECRET_ENV}, "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1", **(extra or {})}


def start_zygote(module: str, extra_env: dict | None = None) -> Zygote:
    """A zygote for ``module``'s children (``launch.zygote``), in the environment they get from ``spawn``."""
    return Zygote(module, child_env(extra_env), preexec_fn=_child_setup)


def spawn(slot: Slot, module: str, args: list[str], pass_fds: tuple[int, ...] = (), env: dict | None = None,
          zygote: Zygote | None = None, wait: bool = True) -> Child:
    """Start ``python -m module`` for a slot, in its own session, dying with the supervisor: forked from
    ``zygote`` where it can (``wait``: for its imports, if it is still at them), else a fresh interpreter."""
    environment = child_env(env)

    def command_line() -> tuple[int, int, int, int, list[str]]:
        status_r, status_w = os.pipe()
        control_r, control_w = os.pipe()
        return status_r, status_w, control_r, control_w, [
            *args, "--status-fd", str(status_w), "--control-fd", str(control_r), "--parent-pid", str(os.getpid())]

    status_r, status_w, control_r, control_w, argv = command_line()
    proc = zygote.fork(argv, (status_w, control_r, *pass_fds), environment, wait) if zygote is not None else None
    if proc is None:
        if zygote is not None:  # new pipes: a fork the zygote made after all, too late, finds these closed and exits
            for fd in (status_r, status_w, control_r, control_w):
                os.close(fd)
            status_r, status_w, control_r, control_w, argv = command_line()
        proc = subprocess.Popen([sys.executable, "-m", module, *argv], pass_fds=(status_w, control_r, *pass_fds),
                                start_new_session=True, preexec_fn=_child_setup, env=environment,
                                stdin=subprocess.DEVNULL)
    os.close(status_w)
    os.close(control_r)
    os.set_blocking(status_r, False)
    os.set_blocking(control_w, False)
    return Child(slot, proc, status_r, control_w)
