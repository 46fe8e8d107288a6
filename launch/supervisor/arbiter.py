"""The arbiter: the processes of one server, kept at their desired counts (gunicorn's arbiter is the model).

It knows each tier's desired count and its processes, nothing of cluster policy. Each turn (``turn``) reaps
children that exited (an unexpected exit is a failure of its slot: backoff, crash-loop detection, cleanup; a boot
error stops the supervisor at once), aborts hung ones (no heartbeat: SIGABRT for faulthandler's traceback, then
SIGKILL), starts or drains processes until each tier has its desired count, and marks a model ``failed`` once
every engine of it crash-loops (the admission owner refuses its requests; the server stops only when every model
failed, the gateways did, or with ``--exit-on-crash-loop``). Scaling is a change of a desired count; draining is
SIGTERM to the victim. Signals arrive through a socket pair, so each is handled in the loop, in one place. What
the arbiter cannot decide itself it asks the supervisor through ``ArbiterHooks``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from protocol.constants import EXIT_BOOT_ERROR
from protocol.control import PIPE_EVENTS, Ack, BootFailed, ControlMessage, Heartbeat, Ready
from protocol.kv_events import replay_endpoint

from ..children import CRASH_LOOP_WINDOW, Child, Slot
from ..hosts.engine_registry import engine_endpoint, kv_events_endpoint, kv_events_ports
from ..tiers import ModelTier, ServeConfig

log = logging.getLogger("zserve.launch")

ABORT_GRACE = 3.0  # seconds a hung child has to write its traceback after SIGABRT before SIGKILL


class TierFailed(RuntimeError):
    pass


@dataclass
class ArbiterHooks:
    """What the arbiter asks of the supervisor: start a child in a slot; a status line it does not handle (an
    expert-parallel report); an unexpected death (True: an operation handled it); a drain about to begin
    (gateways stop routing to the engine first); SIGHUP (a rolling restart)."""

    start: Callable[[Slot], Child]
    event: Callable[[Child, ControlMessage], None] = lambda child, msg: None
    died: Callable[[Child, str], bool] = lambda child, why: False
    draining: Callable[[], object] = lambda: None
    reload: Callable[[], object] = lambda: None


class Arbiter:
    def __init__(self, cfg: ServeConfig, tiers: list[ModelTier], hooks: ArbiterHooks):
        self.cfg, self.tiers, self.hooks = cfg, tiers, hooks
        self.desired = {"gateway": cfg.gateways}
        self.slots: dict[tuple[str, int], Slot] = {}
        self.children: list[Child] = []
        self.sel = selectors.DefaultSelector()
        self.run_dir = ""
        self.num_gpus = 0
        self.ready_timeout, self.shutdown_timeout = cfg.ready_timeout, cfg.shutdown_timeout
        self.failed: dict[str, str] = {}  # model id → why every engine of it is crash-looping
        self.stopping = self.fast_stop = False
        self._signal_r, self._signal_w = socket.socketpair()
        for s in (self._signal_r, self._signal_w):
            s.setblocking(False)
        self.sel.register(self._signal_r, selectors.EVENT_READ, self._read_signals)

    # -- what operations see (launch.interfaces.Processes) ----------------------------------------------------
    def live(self, tier: str) -> list[Child]:
        return [c for c in self.children if c.tier == tier and c.alive]

    def slot(self, tier: str, index: int) -> Slot:
        slot = self.slots.get((tier, index))
        if slot is None:
            model = self.tier_of(index).model_id if tier == "engine" and len(self.tiers) > 1 else ""
            slot = self.slots[(tier, index)] = Slot(tier, index, model=model)
        return slot

    def gateways_desired(self) -> int:
        return self.desired["gateway"]

    @property
    def engines_desired(self) -> int:
        return sum(t.desired for t in self.tiers)

    def tier_of(self, rank: int) -> ModelTier:
        return next(t for t in self.tiers if t.owns(rank))

    def scale(self, tier: str, count: int) -> None:
        if self.desired[tier] != count:
            log.info("scaling %ss %d → %d", tier, self.desired[tier], count)
            self.desired[tier] = count

    def scale_engines(self, tier: ModelTier, count: int) -> None:
        if tier.desired != count:
            log.info("scaling engines of %s %d → %d", tier.model_id, tier.desired, count)
            tier.desired = count

    def engine_endpoint(self, rank: int) -> str:
        if self.cfg.bind is not None:
            return engine_endpoint(self.cfg.bind, rank)
        return f"ipc://{self.run_dir}/engine-{rank}.sock"

    def kv_events_endpoint(self, rank: int) -> str:
        """Where engine ``rank`` publishes its KV cache events: beside its socket on one host, on its own TCP
        ports on an engine host (``launch.hosts.engine_registry.kv_events_ports``; CURVE as the engine's)."""
        if self.cfg.bind is not None:
            first = kv_events_ports(self.cfg.bind, len(self.cfg.models), self.cfg.kv_events_port).start
            return kv_events_endpoint(self.cfg.bind, first, rank)
        return f"ipc://{self.run_dir}/engine-{rank}-kv.sock"

    def engine_threads(self, tier: ModelTier | None = None, size: int | None = None) -> int:
        """CPU threads per engine: engines (of every model) share the cores unless told how many each may use;
        ``size``: as if ``tier`` had that many engines (an expert-parallel group being re-formed)."""
        engines = self.engines_desired - (tier.desired - size if tier is not None and size is not None else 0)
        return max(1, (os.cpu_count() or 1) // max(1, engines))

    def wanted(self) -> list[tuple[str, range, list[Child]]]:
        """Each tier's wanted indices and live processes: the gateways, then every model's engines."""
        engines = self.live("engine")
        return [("gateway", range(self.desired["gateway"]), self.live("gateway")),
                *(("engine", t.ranks, [c for c in engines if t.owns(c.index)]) for t in self.tiers)]

    # -- events ------------------------------------------------------------------------------------------------
    def on_signal(self, signum: int, frame=None) -> None:
        with contextlib.suppress(OSError):
            self._signal_w.send(bytes([signum]))

    def wake(self) -> None:
        """From another thread: turn the loop now (a zero byte is no signal)."""
        self.on_signal(0)

    def _read_signals(self) -> None:
        with contextlib.suppress(BlockingIOError):
            for signum in self._signal_r.recv(64):
                self._handle_signal(signum)

    def _handle_signal(self, signum: int) -> None:
        if signum == signal.SIGHUP and not self.stopping:  # gunicorn's convention: reload, not stop
            self.hooks.reload()
        elif signum in (signal.SIGTERM, signal.SIGINT):
            if self.stopping and signum == signal.SIGINT:
                log.warning("second SIGINT: stopping now without draining")
                self.fast_stop = True
            elif not self.stopping:
                log.info("received %s: draining (up to %.0fs) and stopping", signal.Signals(signum).name,
                         self.cfg.shutdown_timeout)
            self.stopping = True
        elif signum == signal.SIGTTIN:
            self.scale("gateway", self.desired["gateway"] + 1)
        elif signum == signal.SIGTTOU:
            self.scale("gateway", max(1, self.desired["gateway"] - 1))

    def read_status(self, child: Child) -> None:
        try:
            data = os.read(child.status_fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # EOF: the child is exiting; reaping happens in the next turn
            self.sel.unregister(child.status_fd)
            os.close(child.status_fd)
            child.status_fd = -1
            return
        for msg in child.lines.messages(data, PIPE_EVENTS, lambda e: log.warning(
                "%s sent an unreadable status line: %s", child.name, e)):
            child.last_beat = time.monotonic()
            if isinstance(msg, Ready) and not child.ready:
                child.ready_at = time.monotonic()
                log.info("%s ready (pid %d) after %.1fs", child.name, child.pid, child.ready_at - child.started)
            elif isinstance(msg, Heartbeat):
                child.load = msg
            elif isinstance(msg, Ack):
                child.acked_version = msg.version
            elif isinstance(msg, BootFailed):
                child.boot_error = msg.reason
            else:
                self.hooks.event(child, msg)

    def poll(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            key.data()

    # -- the turn ----------------------------------------------------------------------------------------------
    def turn(self, now: float) -> None:
        self.reap(now)
        self.check_hung(now)
        if not self.stopping:
            self._match_counts(now)
            self._check_tiers(now)

    def _spawn(self, tier: str, index: int) -> Child:
        slot = self.slot(tier, index)
        child = self.hooks.start(slot)
        self.sel.register(child.status_fd, selectors.EVENT_READ, partial(self.read_status, child))
        self.children.append(child)
        if slot.restarts or slot.failures:
            log.info("restarted %s as pid %d", child.name, child.pid)
        slot.restarts += 1
        return child

    def reap(self, now: float) -> None:
        for c in [c for c in self.children if not c.alive]:
            self.children.remove(c)
            for _ in range(16):  # what it wrote before exiting (a BootFailed reason); ends at EOF
                if c.status_fd < 0:
                    break
                self.read_status(c)
            if c.status_fd >= 0:
                self.sel.unregister(c.status_fd)
            c.close_pipes()
            self._clean_after(c)
            code = c.proc.returncode
            if c.draining or self.stopping:
                log.info("%s (pid %d) exited with code %s", c.name, c.pid, code)
                continue
            if self.hooks.died(c, c.boot_error or f"exit code {code}"):
                continue  # a new member of an abandoned resize: neither restarted nor fatal
            if code == EXIT_BOOT_ERROR:  # restarting cannot help: stop now (start() or run() reports it)
                c.slot.last_exit = f"boot error: {c.boot_error or 'see its log'}"
                raise TierFailed(f"{c.name} cannot start: {c.boot_error or 'a boot error (see its log above)'} "
                                 f"(exit code {code}); not restarting it")
            why = "hung (no heartbeat)" if c.killed_hung else f"exit code {code}"
            delay = c.slot.record_failure(now, why)
            if c.slot.crash_looping(now):
                log.error("%s is crash-looping: %d failures in %.0fs (last: %s); next try in %.0fs", c.name,
                          len(c.slot.failures), CRASH_LOOP_WINDOW, why, delay)
            else:
                log.error("%s (pid %d) died (%s); restarting it in %.1fs", c.name, c.pid, why, delay)

    def _clean_after(self, c: Child) -> None:
        if c.tier == "engine":  # its ipc sockets: its own and its KV events' (a killed engine leaves them behind)
            kv = self.kv_events_endpoint(c.index)
            for endpoint in (self.engine_endpoint(c.index), kv, replay_endpoint(kv)):
                if not endpoint.startswith("ipc://"):
                    continue  # a TCP port (an engine host's) closed with its process
                path = endpoint.removeprefix("ipc://")
                if os.path.exists(path) and not [o for o in self.live("engine") if o.index == c.index]:
                    os.unlink(path)
        else:
            with contextlib.suppress(ImportError):
                from prometheus_client import multiprocess

                multiprocess.mark_process_dead(c.pid, os.path.join(self.run_dir, "metrics"))

    def check_hung(self, now: float) -> None:
        for c in self.children:
            if not c.alive:
                continue
            if c.killed_hung:
                if c.aborted_at is not None and now - c.aborted_at > ABORT_GRACE:
                    c.signal(signal.SIGKILL)  # still there (stopped, or stuck where no handler runs)
                continue
            if c.ready and now - c.last_beat > self.cfg.heartbeat_timeout:
                log.error("%s (pid %d) sent no heartbeat for %.0fs; killing it", c.name, c.pid, now - c.last_beat)
            elif not c.ready and now - c.started > self.cfg.ready_timeout:
                log.error("%s (pid %d) not ready after %.0fs; killing it", c.name, c.pid, now - c.started)
            else:
                continue
            c.killed_hung = True
            c.aborted_at = now
            log.error("%s (pid %d): SIGABRT for a traceback of where it hangs; SIGKILL in %.0fs", c.name, c.pid,
                      ABORT_GRACE)
            c.signal(signal.SIGABRT)
            c.signal(signal.SIGCONT)  # a stopped process (SIGSTOP, a frozen host) handles it now, not at the SIGKILL

    def _match_counts(self, now: float) -> None:
        for tier, wanted, live in self.wanted():
            active = {c.index for c in live if not c.draining}
            # Dead since this turn's reap (a second poll): replaced only once reaped, when its failure is recorded
            # and its backoff set; replaced now, a slot ran two processes and counted two failures for one restart.
            unreaped = {c.index for c in self.children if c.tier == tier and not c.alive}
            for index in wanted:
                slot = self.slot(tier, index)
                busy = [c for c in live if c.index == index]  # a draining process still holds the socket
                if (index not in active and index not in unreaped and now >= slot.next_start
                        and not (tier == "engine" and busy)):
                    self._spawn(tier, index)
            for c in live:
                if c.index not in wanted and not c.draining:
                    log.info("draining %s (pid %d)", c.name, c.pid)
                    c.draining = True
                    c.drain_started = now
                    self.hooks.draining()  # gateways stop routing to a draining engine before it hears SIGTERM
                    c.signal(signal.SIGTERM)
            for c in live:
                if c.draining and c.drain_started and now - c.drain_started > self.cfg.shutdown_timeout + 5:
                    log.warning("%s did not finish draining in time; killing it", c.name)
                    c.signal(signal.SIGKILL)

    def _check_tiers(self, now: float) -> None:
        """A tier whose processes are all crash-looping: the gateways' stops the server, a model's fails that
        model (the others serve on) until an engine of it is ready again."""
        for tier, wanted, live in self.wanted():
            model = self.tier_of(wanted[0]).model_id if tier == "engine" and wanted else None
            slots = [self.slot(tier, i) for i in wanted]
            if any(c.ready for c in live):
                if self.failed.pop(model or "", None) is not None:
                    log.info("%s serves again: an engine of it is ready", model)
                continue
            if not slots or not all(s.crash_looping(now) for s in slots) or (model in self.failed):
                continue
            reasons = "; ".join(f"{s.name}: {s.last_exit}" for s in slots)
            which = f"{model}'s engine tier" if model else "the gateway tier"
            if model is None or self.cfg.exit_on_crash_loop or len(self.failed) + 1 >= len(
                    [t for t in self.tiers if t.desired]):
                raise TierFailed(f"{which} cannot run: every {tier} is crash-looping ({reasons})")
            self.failed[model] = reasons
            log.error("%s cannot run: every engine is crash-looping (%s); its requests are refused, the other "
                      "models serve on (--exit-on-crash-loop stops the server instead)", which, reasons)
