"""Children forked from a process that has imported their code already: a zygote, as Android starts its apps.

A fresh ``python -m engine_worker`` spends 1.5 s of CPU importing torch before its first line runs; a gateway 0.5 s
importing aiohttp and the rest. The supervisor starts one zygote per module when it starts (``python -m
launch.zygote MODULE FD``): it imports the module's code once and waits. Every child of that module is then a fork
of it, running its own code within milliseconds: an engine that died is back sooner, a server with several engines
imports torch once, and a scale-up or a rolling reload takes no CPU for imports from the engines serving meanwhile.

The child is still the supervisor's own. The zygote forks twice and the middle process exits at once, so the child
is reparented to the supervisor, a child subreaper (``PR_SET_CHILD_SUBREAPER``): the supervisor waits on it, signals
it and reads its exit code as for any child (``ForkedChild`` is the part of ``subprocess.Popen`` it uses), and the
child's ``PR_SET_PDEATHSIG`` names the supervisor, so a ``kill -9`` of the supervisor takes it too. The zygote
replies with the child's pid only once the middle process is reaped, when the reparenting is done; the child waits
for it too before its ``die_with_parent`` check.

A fork carries over what a fresh process would not: the imported modules and what they read from the environment
when imported. So a zygote serves one module with one environment, the one its children get, and a start that asks
for another, or finds the zygote dead, silent or (once the server serves) still importing, is a ``subprocess``
start as before: a zygote only ever costs the speed. The supervisor replaces one that died
(``launch.supervisor.server``); the zygote says when its imports are done, and its title says so too.

The child's pipes come over the zygote's socket (``SCM_RIGHTS``) and take the numbers the command line names, and
it runs in a session of its own, as ``spawn`` starts one. The descriptors the imports opened stay open: Python
objects own them (prometheus_client's files, which it reopens itself in a new pid), and closing them behind their
backs once let a reused number close the event loop's epoll. The zygote keeps them above the supervisor's numbers
(``RESERVED_FDS``); a start whose pipe numbers would meet one goes by ``subprocess``. ``ZSERVE_PRELOAD=0`` starts
every child with ``subprocess``.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib
import os
import signal
import socket
import subprocess
import sys
import time
import traceback

import orjson

from zserve.heap import settle

ENTRY = {"engine_worker": "engine_worker.engine", "gateway": "gateway.server"}
"""Each module the supervisor starts children of, and the module whose ``main(argv)`` runs them."""
PR_SET_CHILD_SUBREAPER = 36
FIRST_FORK_TIMEOUT = 60.0  # the zygote's own imports come first (a fresh child's too)
FORK_TIMEOUT = 10.0
MAX_FDS = 8
RESERVED_FDS = 256  # descriptors below this are the supervisor's numbers, kept free of the zygote's own


def enabled() -> bool:
    return os.environ.get("ZSERVE_PRELOAD", "1").strip().lower() not in ("0", "false", "no", "off")


def become_subreaper() -> bool:
    """Make orphaned descendants this process's children (Linux 3.4+); False where that cannot be had."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def reap_orphans(known: set[int]) -> None:
    """Reap the exited children that are no ``Popen``'s or ``ForkedChild``'s: descendants orphaned to this subreaper
    (a compiler an engine ran when it was killed, say). Looks without reaping first, so a known child's status stays
    for its own ``poll``."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid in known:
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, 0)


class ForkedChild:
    """A child a zygote forked, reparented to this process: what the supervisor uses of ``subprocess.Popen``."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args, self.returncode = pid, args, None

    def _reaped(self, status: int) -> int:
        self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: gone, its code unknown
                self.returncode = 255
            else:
                if pid:
                    self._reaped(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            while self.returncode is None:
                try:
                    self._reaped(os.waitpid(self.pid, 0)[1])
                except ChildProcessError:
                    self.returncode = 255
                except InterruptedError:
                    continue
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.005)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The supervisor's end of one zygote: ``fork`` starts a child of ``module`` from it, or returns None."""

    def __init__(self, module: str, env: dict[str, str], preexec_fn=None):
        self.module, self.env, self.is_ready = module, env, False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "launch.zygote", module, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                start_new_session=True, preexec_fn=preexec_fn, env=env, stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours

    @property
    def alive(self) -> bool:
        return self.sock is not None and self.proc.poll() is None

    def ready(self, timeout: float) -> bool:
        """Whether the zygote has done its imports (it says so once), waiting up to ``timeout`` seconds (0: only
        asking); a zygote that died or stays silent past a wait is closed."""
        if self.is_ready or not self.alive:
            return self.is_ready and self.alive
        try:
            self.sock.settimeout(max(0.0, timeout))  # (0: non-blocking)
            said = orjson.loads(self.sock.recv(4096) or b"{}")
        except BlockingIOError:  # only asking, and nothing said yet
            return False
        except (OSError, ValueError):  # silent past the wait (TimeoutError), or gone
            said = {}
        self.is_ready = said.get("ready") is True
        if not self.is_ready:
            self.close()
        return self.is_ready

    def fork(self, args: list[str], fds: tuple[int, ...], env: dict[str, str], wait: bool = True
             ) -> ForkedChild | None:
        """Start ``python -m MODULE ARGS`` as a fork, with ``fds`` open under their own numbers; None where this
        zygote cannot (dead, silent, another environment, or still importing and ``wait`` is false): the caller
        starts it with ``subprocess``."""
        if env != self.env or len(fds) > MAX_FDS or not self.ready(FIRST_FORK_TIMEOUT if wait else 0):
            return None
        try:
            socket.send_fds(self.sock, [orjson.dumps({"args": args, "fds": list(fds)})], list(fds))
            self.sock.settimeout(FORK_TIMEOUT)
            reply = orjson.loads(self.sock.recv(4096) or b"{}")
        except (OSError, ValueError):
            reply = {}
        pid = reply.get("pid", False)
        if pid is None:  # (it could not take this one: a descriptor's number)
            return None
        if not isinstance(pid, int):
            self.close()  # dead or too slow: the rest of this server's starts go without it
            return None
        return ForkedChild(pid, [sys.executable, "-m", self.module, *args])

    def close(self) -> None:
        """Stop the zygote (its children run on: they are the supervisor's)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


# -- the zygote process ----------------------------------------------------------------------------------------

def _become_child(request: dict, fds: list[int], supervisor: int) -> None:
    """In the forked child: take the supervisor as parent, the pipes' numbers and a session; run the module."""
    code = 1
    try:
        deadline = time.monotonic() + 10
        while os.getppid() != supervisor:  # (the middle process exits at once; the supervisor then adopts us)
            if time.monotonic() > deadline:
                os._exit(1)
            time.sleep(0.001)
        os.setsid()
        targets = request["fds"]
        top = max([*targets, *fds]) + 1
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, top) for fd in fds]  # (out of the way of every target first)
        for fd in fds:
            os.close(fd)
        for target, fd in zip(targets, moved):
            os.dup2(fd, target)
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.argv = [sys.executable, *request["args"]]
        importlib.import_module(ENTRY[request["module"]]).main(request["args"])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _free(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def _open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd") if not _free(int(n))}


def _fork_one(sock: socket.socket, request: dict, fds: list[int], supervisor: int) -> int | None:
    """Fork twice; the grandchild runs the module. Returns its pid once the middle process is reaped."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(r)
            sock.close()
            child = os.fork()
            if child == 0:
                os.close(w)
                _become_child(request, fds, supervisor)
            os.write(w, str(child).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        text = f.read()
    os.waitpid(middle, 0)
    return int(text) if text.strip().isdigit() else None


def main(argv: list[str]) -> None:
    """``python -m launch.zygote MODULE FD``: import MODULE's code, then fork a child for each request on FD."""
    from zserve.proc import set_title

    module, fd = argv[0], int(argv[1])
    supervisor = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_title(f"zserve: preload {module} (importing)")
    sock = socket.socket(fileno=fd)
    # What the imports open (libraries' own descriptors, which a fork keeps) goes above the numbers the supervisor's
    # pipes take, so that a child's pipes can have their numbers without closing one of them.
    null = os.open(os.devnull, os.O_RDONLY)
    held = [n for n in range(3, RESERVED_FDS) if n not in (fd, null) and _free(n)]
    for n in held:
        os.dup2(null, n)
    importlib.import_module(ENTRY[module])
    for n in (*held, null):
        os.close(n)
    own = _open_fds() - {0, 1, 2, fd}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # (a fork could not use CUDA: refuse, starts go on fresh)
        print(f"zserve zygote for {module}: CUDA was initialised by an import; not forking", file=sys.stderr)
        return
    settle()  # the imported code, shared with every child: no collection there writes to those pages
    sock.send(orjson.dumps({"ready": True}))
    set_title(f"zserve: preload {module}")
    while True:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, 65536, MAX_FDS)
        except OSError:
            return
        if not data:  # the supervisor closed its end (or died): nothing more to start
            return
        try:
            request = {**orjson.loads(data), "module": module}
            if own & set(request["fds"]):  # (the supervisor starts this one itself)
                pid = None
            else:
                pid = _fork_one(sock, request, fds, supervisor)
        except (OSError, ValueError, KeyError) as e:
            print(f"zserve zygote for {module}: cannot fork: {e}", file=sys.stderr, flush=True)
            pid = None
        finally:
            for f in fds:
                os.close(f)
        with contextlib.suppress(OSError):
            sock.send(orjson.dumps({"pid": pid}))


if __name__ == "__main__":
    main(sys.argv[1:])
