"""The supervisor: a reconcile loop over two tiers of processes (gunicorn's arbiter is the model).

Each turn of the loop waits for something to happen — a status line from a child, a control
command (``control_server``), a signal, or a one-second tick; each selector key carries the
callback that handles it — then:

1. reaps children that exited (an unexpected exit is a failure of its slot: backoff, crash-loop
   detection, cleanup of its ipc socket and metric files; a boot error — a configuration that can
   never start — stops the supervisor at once);
2. aborts children whose heartbeats stopped (hung: SIGABRT, so faulthandler logs where they hang,
   then SIGKILL), which step 1 then replaces;
3. starts or drains processes until each tier has its desired count;
4. publishes the cluster state (engine membership, pause) to every gateway when it changed.

Scaling is only a change of a desired count; draining is SIGTERM to the victim, which finishes its
work and exits. Children run in their own session with a parent-death signal, so the terminal's
Ctrl-C reaches only the supervisor and ``kill -9`` of the supervisor takes every child with it.
Each model served has its own engine tier (``ModelTier``): its own configuration, desired count and
range of ranks, so its engines are scaled, restarted and drained on their own while every gateway
serves every model. A render server (``launch render``) is the same loop with no engines at all.
Tiers may live on different hosts (``launch.engine_registry``): an engine host (``launch engine``) is this
loop with no gateways, serving its engines' membership to gateway hosts; a gateway host (``launch api-server
--engine tcp://…``) is this loop with no local engines, merging the engine hosts' engines into the cluster
state it gives its gateways.
"""

from __future__ import annotations

import logging
import os
import selectors
import shutil
import signal
import socket
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from functools import partial

from gateway.config import GatewayConfig
from gateway.security import write_key_file
from protocol import ProtocolError
from protocol.cluster import PAUSING_PHASES, EngineInfo, EngineState
from protocol.constants import EXIT_BOOT_ERROR, EXIT_CUT_OFF
from protocol.control import (
    PIPE_EVENTS,
    Ack,
    BootFailed,
    ClusterUpdate,
    ControlMessage,
    ElasticScaleCommand,
    ElasticScaleReply,
    EngineRegistry,
    ErrorReply,
    GroupReport,
    Heartbeat,
    PauseCommand,
    PauseReply,
    ProcessStatus,
    Ready,
    ReloadCommand,
    ResumeCommand,
    ScaleCommand,
    ScaleReply,
    StatusCommand,
    StatusReply,
    StopCommand,
    StopReply,
)
from zserve import control
from zserve.catalog import ModelSource
from zserve.cluster import ClusterStore
from zserve.config import MAX_ENGINES_PER_MODEL, ModelSpec
from zserve.curve import CurveKeys, tcp_port
from zserve.devices import cuda_device_count, engine_device
from zserve.paths import no_cache_warning, user_cache_dir

from . import handoff, systemd
from .children import CRASH_LOOP_WINDOW, Child, Slot, spawn
from .control_server import AwaitAcks, ControlServer
from .elastic import ElasticGroup, Later
from .engine_registry import RegistryServer, RemoteEngines, engine_endpoint
from .reload import RollingRestart
from .shared_state import SharedControl, is_redis
from .sockets import UnixHTTPConnection, create_listener, create_unix_listener

log = logging.getLogger("zserve.launch")

ABORT_GRACE = 3.0  # seconds a hung child has to write its traceback after SIGABRT before SIGKILL
EXIT_SUPERVISOR_FAILED = 70
"""launch's exit code when the supervisor itself failed (an unexpected exception, a bug: its traceback is in the
log); its children were stopped as at SIGTERM. sysexits' EX_SOFTWARE, so systemd's Restart=on-failure restarts it."""


def _remove_socket_file(path: str, inode: int | None) -> None:
    """Unlink a ``--uds`` socket's file, unless another server has bound the path since (another inode)."""
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except OSError:
        pass


def _dropped_status(child: Child, e: ProtocolError) -> None:
    log.warning("%s sent an unreadable status line: %s", child.name, e)


def _scale_reply(model: str, reply: ElasticScaleReply) -> ControlMessage:
    """``launch scale engine`` of an expert-parallel tier gets the answer a scale command expects."""
    if reply.outcome == "ok":
        return ScaleReply("engine", reply.size, model)
    return ErrorReply(reply.message)


class StartupError(RuntimeError):
    pass


class TierFailed(RuntimeError):
    pass


@dataclass
class ServeConfig:
    """One server: its models (each with the engine tier its spec asks for), the gateways' configuration,
    and the supervisor's own settings."""

    models: list[tuple[ModelSource, ModelSpec]]  # in order: the first is the default model of a request
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    api_keys: tuple[str, ...] = ()  # gateway.security: written as digests to a file only this user reads
    admin_keys: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    uds: str | None = None  # serve on this Unix socket instead of host:port
    gateways: int = 2
    ready_timeout: float = 600.0
    shutdown_timeout: float = 30.0
    heartbeat_timeout: float = 30.0
    heartbeat_interval: float = 1.0
    # Tiers on different hosts (launch.engine_registry): an engine host binds its registry here and runs no
    # gateway; a gateway host runs no engine and uses the engine hosts at these registry URLs.
    bind: str | None = None
    remote_engines: tuple[str, ...] = ()
    keys_dir: str | None = None  # CURVE keys (zserve.curve); None: plain TCP (--insecure) or one host (ipc)


@dataclass
class ModelTier:
    """One model's engine tier. Model m owns engine ranks m * 64 .. m * 64 + 63, so every engine's rank,
    socket, seed and slot stay unique across models; its engines take GPUs from ``first_device`` on."""

    source: ModelSource
    spec: ModelSpec
    desired: int
    base: int
    first_device: int

    @property
    def model_id(self) -> str:
        return self.source.model_id

    @property
    def names(self) -> tuple[str, ...]:
        return self.spec.names or (self.model_id,)

    @property
    def ranks(self) -> range:
        return range(self.base, self.base + self.desired)

    def owns(self, rank: int) -> bool:
        return self.base <= rank < self.base + MAX_ENGINES_PER_MODEL


class Supervisor:
    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.desired = {"gateway": cfg.gateways}
        self.tiers = [ModelTier(source, spec, spec.engines, m * MAX_ENGINES_PER_MODEL,
                                sum(s.engines for _, s in cfg.models[:m]))
                      for m, (source, spec) in enumerate(cfg.models)]
        self.slots: dict[tuple[str, int], Slot] = {}
        self.children: list[Child] = []
        self.store = ClusterStore()
        self.sel = selectors.DefaultSelector()
        self.run_dir = ""
        self.listener: socket.socket | None = None
        self.control: ControlServer | None = None
        self.control_path = ""
        self.pointer = ""
        self.url = ""
        self._signal_r, self._signal_w = socket.socketpair()
        for s in (self._signal_r, self._signal_w):
            s.setblocking(False)
        self.stopping = False
        self.fast_stop = False
        self.exit_code = 0
        self.started_at = time.time()
        self._last_watchdog = 0.0
        self.num_gpus = 0
        self._uds_inode: int | None = None
        # Expert-parallel tiers (by their first rank): each one group, formed, resized and re-formed here.
        self.elastic = {t.base: ElasticGroup(self, t) for t in self.tiers if t.spec.engine.expert_parallel}
        self._scaling_version = 0  # the cluster-state version that paused admission for a resize
        self._operator_paused = False  # /pause given by an operator (restored when a resize resumes)
        self.reloading: RollingRestart | None = None  # SIGHUP / launch reload in progress
        self.registry: RegistryServer | None = None  # an engine host's
        self.remote: list[RemoteEngines] = []  # a gateway host's engine hosts
        self._unknown_models: set[str] = set()  # served by an engine host but not here (warned once)
        self._remote_phase = ""  # an engine host's pausing phase, followed here
        self.shared: SharedControl | None = None  # the control state of every gateway host (--state-url redis)
        self._shared_local = 0  # the cluster-state version that applied the shared state's latest
        self._shared_waits: dict[int, int] = {}  # a pause's cluster-state version → its shared version

    # -- set-up ------------------------------------------------------------------------------
    def _make_run_dir(self) -> None:
        base = control.runtime_base()
        for d in os.listdir(base):  # run dirs of supervisors that died without cleaning up
            pid_file = os.path.join(base, d, "supervisor.pid")
            if d.startswith("run-") and os.path.exists(pid_file):
                try:
                    os.kill(int(open(pid_file).read()), 0)
                except (ProcessLookupError, ValueError):
                    shutil.rmtree(os.path.join(base, d), ignore_errors=True)
                except PermissionError:
                    pass
        self.run_dir = tempfile.mkdtemp(prefix="run-", dir=base)
        with open(os.path.join(self.run_dir, "supervisor.pid"), "w") as f:
            f.write(str(os.getpid()))
        os.makedirs(os.path.join(self.run_dir, "metrics"), exist_ok=True)
        if self.cfg.api_keys or self.cfg.admin_keys:
            write_key_file(self.key_file, self.cfg.api_keys, self.cfg.admin_keys)

    @property
    def render_only(self) -> bool:
        """A server without engines (launch render): gateways render requests and never generate."""
        return not self.cfg.remote_engines and all(spec.engines == 0 for _, spec in self.cfg.models)

    @property
    def engines_desired(self) -> int:
        return sum(t.desired for t in self.tiers)

    @property
    def model_ids(self) -> str:
        return ", ".join(t.model_id for t in self.tiers)

    def tier_of(self, rank: int) -> ModelTier:
        return next(t for t in self.tiers if t.owns(rank))

    def find_tier(self, model: str | None) -> ModelTier:
        """The tier serving ``model`` (its id or a served name; None while one model is served)."""
        if model is None and len(self.tiers) == 1:
            return self.tiers[0]
        found = [t for t in self.tiers if model == t.model_id or model in t.names]
        if model is None or not found:
            said = "name the model" if model is None else f"no model {model!r} is served"
            raise LookupError(f"{said}: one of {self.model_ids}")
        return found[0]

    @property
    def cache_dir(self) -> str:
        """Where gateways keep tokenizers built from GGUF metadata across restarts (2 s → 0.1 s a start);
        falls back to the run directory when the user's cache directory cannot be written."""
        path = user_cache_dir()
        if path is not None:
            return path
        path = os.path.join(self.run_dir, "cache")
        os.makedirs(path, exist_ok=True)
        return path

    @property
    def key_file(self) -> str:
        return os.path.join(self.run_dir, "keys.json")

    def engine_endpoint(self, rank: int) -> str:
        if self.cfg.bind is not None:
            return engine_endpoint(self.cfg.bind, rank)
        return f"ipc://{self.run_dir}/engine-{rank}.sock"

    def _slot(self, tier: str, index: int) -> Slot:
        slot = self.slots.get((tier, index))
        if slot is None:
            model = self.tier_of(index).model_id if tier == "engine" and len(self.tiers) > 1 else ""
            slot = self.slots[(tier, index)] = Slot(tier, index, model=model)
        return slot

    # -- spawning ----------------------------------------------------------------------------
    def _spawn(self, tier: str, index: int) -> Child:
        c = self.cfg
        slot = self._slot(tier, index)
        if tier == "engine":
            mt = self.tier_of(index)
            group = self.elastic.get(mt.base)
            engine = handoff.engine_launch(
                index, self.engine_endpoint(index), mt.source, mt.spec.engine, threads=self.engine_threads(),
                device=engine_device(mt.first_device + index - mt.base, self.num_gpus),
                heartbeat_interval=c.heartbeat_interval, expert_share=group.share(index) if group else None,
                keys_dir=c.keys_dir if c.bind is not None else None)
            child = spawn(slot, "engine_worker", handoff.argv(engine))
        else:
            assert self.listener is not None
            fd = self.listener.fileno()
            gateway = handoff.gateway_launch(
                index, fd, [(t.source, t.names) for t in self.tiers], c.gateway, render_only=self.render_only,
                cache_dir=self.cache_dir, control_socket=self.control_path, shutdown_timeout=c.shutdown_timeout,
                heartbeat_interval=c.heartbeat_interval, responses_db=os.path.join(self.run_dir, "responses.db"),
                key_file=self.key_file if c.api_keys or c.admin_keys else None,
                keys_dir=c.keys_dir if c.remote_engines else None)
            env = {"PROMETHEUS_MULTIPROC_DIR": os.path.join(self.run_dir, "metrics")}
            child = spawn(slot, "gateway", handoff.argv(gateway), pass_fds=(fd,), env=env)
            child.send(ClusterUpdate(self.store.get()))
        self.sel.register(child.status_fd, selectors.EVENT_READ, partial(self._read_status, child))
        self.children.append(child)
        if slot.restarts or slot.failures:
            log.info("restarted %s as pid %d", child.name, child.pid)
        slot.restarts += 1
        return child

    def engine_threads(self, tier: ModelTier | None = None, size: int | None = None) -> int:
        """CPU threads per engine: engines (of every model) share the cores unless told how many each may use;
        ``size``: as if ``tier`` had that many engines (an expert-parallel group being re-formed)."""
        engines = self.engines_desired - (tier.desired - size if tier is not None and size is not None else 0)
        return max(1, (os.cpu_count() or 1) // max(1, engines))

    def _live(self, tier: str) -> list[Child]:
        return [c for c in self.children if c.tier == tier and c.alive]

    # -- events ------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame) -> None:
        try:
            self._signal_w.send(bytes([signum]))
        except OSError:
            pass

    def _wake(self) -> None:
        """From another thread: turn the loop now (a zero byte is no signal)."""
        self._on_signal(0, None)

    def _read_signals(self) -> None:
        try:
            for signum in self._signal_r.recv(64):
                self._handle_signal(signum)
        except BlockingIOError:
            pass

    def _handle_signal(self, signum: int) -> None:
        if signum == signal.SIGHUP and not self.stopping:  # gunicorn's convention: reload, not stop
            self.reload()
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

    def _read_status(self, child: Child) -> None:
        try:
            data = os.read(child.status_fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # EOF: the child is exiting; reaping happens in reconcile
            self.sel.unregister(child.status_fd)
            os.close(child.status_fd)
            child.status_fd = -1
            return
        for msg in child.lines.messages(data, PIPE_EVENTS, partial(_dropped_status, child)):
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
            elif isinstance(msg, GroupReport):
                group = self._group_of(child)
                if group is not None:
                    group.on_report(child, msg)

    def command(self, cmd: ControlMessage) -> ControlMessage | AwaitAcks:
        """Carry out one control-socket command (the ControlServer's dispatch)."""
        if isinstance(cmd, StatusCommand):
            return self.status()
        if isinstance(cmd, ScaleCommand):
            if cmd.tier_name == "gateway":
                self.scale("gateway", cmd.count)
                return ScaleReply("gateway", cmd.count)
            if self.render_only:
                return ErrorReply("this is a render server (launch render): it has no engine tier to scale")
            try:
                tier = self.find_tier(cmd.model)
            except LookupError as e:
                return ErrorReply(f"scale engine: {e}")
            if cmd.count > MAX_ENGINES_PER_MODEL:
                return ErrorReply(f"a model has at most {MAX_ENGINES_PER_MODEL} engines")
            group = self.elastic.get(tier.base)
            if group is not None:  # an expert-parallel tier is resized as one group
                return group.request(cmd.count, ElasticScaleCommand(cmd.count).drain_timeout,
                                     Later(convert=partial(_scale_reply, tier.model_id)))
            self.scale_engines(tier, cmd.count)
            return ScaleReply("engine", cmd.count, tier.model_id)
        if isinstance(cmd, ElasticScaleCommand):
            return self._elastic_scale(cmd)
        if isinstance(cmd, (PauseCommand, ResumeCommand)):
            paused = isinstance(cmd, PauseCommand)
            shared = self.shared.publish(paused) if self.shared is not None else None
            state = self._apply_pause(paused)
            if self.shared is not None and shared is None:  # Redis is away: this host only, and said so
                return AwaitAcks(state.version, PauseReply(paused, state.version, ("the shared state (Redis)",)))
            if shared is not None:
                self._shared_waits = {v: s for v, s in self._shared_waits.items() if v > state.version - 64}
                self._shared_waits[state.version] = shared
            return AwaitAcks(state.version, PauseReply(paused, state.version))
        if isinstance(cmd, ReloadCommand):
            answer = Later()
            self.reload().answers.append(answer)
            return answer
        if isinstance(cmd, StopCommand):
            self.stopping = True
            return StopReply()
        return ErrorReply(f"unknown command {cmd.TYPE!r}")

    def _apply_pause(self, paused: bool):
        """An operator's pause or resume, on this host's gateways."""
        self._operator_paused = paused
        state = self.store.get()
        if state.scaling in PAUSING_PHASES:  # a resize holds admission; its end restores the operator's word
            return state
        if state.paused != paused:
            state = self.store.update(paused=paused)
            self._broadcast()
            log.info("admission %s (cluster state v%d)", "paused" if paused else "resumed", state.version)
        self._shared_local = state.version
        return state

    def _lagging_anywhere(self, version: int) -> list[str]:
        """What has not applied cluster-state ``version`` yet: gateways here, and other gateway hosts when it
        carried a shared pause or resume."""
        behind = self._lagging(version)
        shared = self._shared_waits.get(version)
        if not behind and shared is not None and self.shared is not None:
            behind = [name[:64] for name in self.shared.applied_by_all(shared)]
        return behind

    def _follow_shared(self, now: float) -> None:
        assert self.shared is not None
        paused = self.shared.poll(now, lambda: not self._lagging(self._shared_local))
        if paused is not None and paused != self._operator_paused:
            log.info("the shared control state says %s", "pause" if paused else "resume")
        if paused is not None:
            self._apply_pause(paused)

    def _elastic_scale(self, cmd: ElasticScaleCommand) -> ControlMessage | Later:
        groups = list(self.elastic.values())
        if cmd.model is not None:
            try:
                tier = self.find_tier(cmd.model)
            except LookupError as e:
                return ErrorReply(f"scale_elastic_ep: {e}")
            groups = [g for g in groups if g.tier is tier]
        if len(groups) != 1:
            said = (f"model {cmd.model!r} is not" if cmd.model else "no model is" if not groups else
                    "several models are")
            return ErrorReply(f"{said} served expert parallel (launch api-server --expert-parallel)"
                              + ("; name the model" if len(groups) > 1 else ""))
        return groups[0].request(cmd.size, cmd.drain_timeout, Later())

    def reload(self) -> RollingRestart:
        """Start a rolling restart (``launch.reload``), or join the one in progress."""
        if self.reloading is None:
            self.reloading = RollingRestart.begin(self)
        else:
            log.info("reload: one is in progress already")
        return self.reloading

    def _group_of(self, child: Child) -> ElasticGroup | None:
        if child.tier != "engine":
            return None
        return self.elastic.get(self.tier_of(child.index).base)

    # -- the cluster state while an expert-parallel group resizes ---------------------------------------------
    def _scaling_phase(self) -> str:
        """The phase the cluster state shows: the first group's that is doing anything."""
        return next((g.phase for g in self.elastic.values() if g.phase), "") or self._remote_phase

    def pause_for_scaling(self, phase: str) -> None:
        st = self.store.update(paused=True, scaling=self._scaling_phase() or phase)
        self._scaling_version = st.version
        self._broadcast()
        log.info("admission paused for an expert-parallel %s (cluster state v%d)", st.scaling, st.version)

    def resume_after_scaling(self) -> None:
        phase = self._scaling_phase()
        st = self.store.update(paused=self._operator_paused or phase in PAUSING_PHASES, scaling=phase)
        self._broadcast()
        log.info("admission %s after the expert-parallel change (cluster state v%d)",
                 "still paused" if st.paused else "resumed", st.version)

    def publish_scaling(self) -> None:
        """The phase changed without a change of admission (a resize starting, or ended without a pause)."""
        phase = self._scaling_phase()
        st = self.store.get()
        if st.scaling != phase:
            paused = st.paused if phase in PAUSING_PHASES else self._operator_paused
            self.store.update(scaling=phase, paused=paused)
            self._broadcast()

    def lagging_scaling(self) -> bool:
        """Whether a ready gateway has not yet applied the pause of the running resize."""
        return bool(self._lagging(self._scaling_version))

    def _lagging(self, version: int) -> list[str]:
        """The ready gateways that have not yet applied cluster-state ``version``."""
        behind = [c.name for c in self._live("gateway") if c.ready and c.acked_version < version]
        return behind + self.registry.lagging(version) if self.registry is not None else behind

    def _poll(self, timeout: float) -> None:
        for key, _ in self.sel.select(timeout):
            key.data()

    # -- the reconcile loop --------------------------------------------------------------------
    def scale(self, tier: str, count: int) -> None:
        if self.desired[tier] != count:
            log.info("scaling %ss %d → %d", tier, self.desired[tier], count)
            self.desired[tier] = count

    def scale_engines(self, tier: ModelTier, count: int) -> None:
        if tier.desired != count:
            log.info("scaling engines of %s %d → %d", tier.model_id, tier.desired, count)
            tier.desired = count

    def _wanted(self) -> list[tuple[str, range, list[Child]]]:
        """Each tier's wanted indices and live processes: the gateways, then every model's engines."""
        engines = self._live("engine")
        return [("gateway", range(self.desired["gateway"]), self._live("gateway")),
                *(("engine", t.ranks, [c for c in engines if t.owns(c.index)]) for t in self.tiers)]

    def _reap(self, now: float) -> None:
        for c in [c for c in self.children if not c.alive]:
            self.children.remove(c)
            for _ in range(16):  # what it wrote before exiting (a BootFailed reason); ends at EOF
                if c.status_fd < 0:
                    break
                self._read_status(c)
            if c.status_fd >= 0:
                self.sel.unregister(c.status_fd)
            c.close_pipes()
            self._clean_after(c)
            code = c.proc.returncode
            if c.draining or self.stopping:
                log.info("%s (pid %d) exited with code %s", c.name, c.pid, code)
                continue
            group = self._group_of(c)
            if group is not None and group.on_death(c, c.boot_error or f"exit code {code}"):
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
        if c.tier == "engine":
            path = self.engine_endpoint(c.index).removeprefix("ipc://")
            if os.path.exists(path) and not [o for o in self._live("engine") if o.index == c.index]:
                os.unlink(path)
        else:
            try:
                from prometheus_client import multiprocess

                multiprocess.mark_process_dead(c.pid, os.path.join(self.run_dir, "metrics"))
            except ImportError:
                pass

    def _check_hung(self, now: float) -> None:
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

    def _match_counts(self, now: float) -> None:
        for tier, wanted, live in self._wanted():
            active = {c.index for c in live if not c.draining}
            for index in wanted:
                slot = self._slot(tier, index)
                busy = [c for c in live if c.index == index]  # a draining process still holds the socket
                if index not in active and now >= slot.next_start and not (tier == "engine" and busy):
                    self._spawn(tier, index)
            for c in live:
                if c.index not in wanted and not c.draining:
                    log.info("draining %s (pid %d)", c.name, c.pid)
                    c.draining = True
                    c.drain_started = now
                    self._publish()  # gateways stop routing to a draining engine before it hears SIGTERM
                    c.signal(signal.SIGTERM)
            for c in live:
                if c.draining and c.drain_started and now - c.drain_started > self.cfg.shutdown_timeout + 5:
                    log.warning("%s did not finish draining in time; killing it", c.name)
                    c.signal(signal.SIGKILL)

    def _check_tiers(self, now: float) -> None:
        for tier, wanted, live in self._wanted():
            slots = [self._slot(tier, i) for i in wanted]
            if any(c.ready for c in live):
                continue
            if slots and all(s.crash_looping(now) for s in slots):
                reasons = "; ".join(f"{s.name}: {s.last_exit}" for s in slots)
                which = "the gateway tier" if tier == "gateway" else f"{self.tier_of(wanted[0]).model_id}'s engine tier"
                raise TierFailed(f"{which} cannot run: every {tier} is crash-looping ({reasons})")

    def _engine_state(self, c: Child) -> EngineState:
        """What gateways are told of an engine: an expert-parallel one is ready only inside its serving group."""
        group = self._group_of(c)
        if group is not None and c.state == EngineState.READY and not group.serves(c.index):
            return EngineState.STARTING
        return c.state

    def _publish(self) -> None:
        engines = tuple(
            EngineInfo(c.index, self.engine_endpoint(c.index), self._engine_state(c), c.pid,
                       self.tier_of(c.index).model_id)
            for c in sorted(self._live("engine"), key=lambda c: c.index)
        )
        models = {t.model_id: t.desired for t in self.tiers}
        local = engines
        engines, models = self._with_remote(engines, models)
        st = self.store.get()
        if engines != st.engines or st.gateways_desired != self.desired["gateway"] or st.models != models:
            st = self.store.update(engines=engines, gateways_desired=self.desired["gateway"],
                                   engines_desired=self.engines_desired, models=models)
            self._broadcast()
        if self._remote_phase and not self._remote_pausing(time.monotonic()):
            self._remote_phase = ""  # resumed after the gateways were told of the replacement, never before
            self.resume_after_scaling()
            st = self.store.get()
        if self.registry is not None:
            self.registry.publish(EngineRegistry(0, local, models, st.scaling), st.version)
        now = time.monotonic()
        for remote in self.remote:
            if remote.fresh(now) and remote.registry is not None:
                remote.carried = (st.version, remote.registry.version)

    def _with_remote(self, engines: tuple[EngineInfo, ...], models: dict[str, int]
                     ) -> tuple[tuple[EngineInfo, ...], dict[str, int]]:
        """Add the engines of the engine hosts that answer (for the models served here) to the local ones, and
        hold admission while one of them pauses its own (it replaces a model's only engine)."""
        now = time.monotonic()
        phase = self._remote_pausing(now)
        if phase and phase != self._remote_phase:  # held before the engine it replaces stops taking requests
            self._remote_phase = phase
            self.pause_for_scaling(phase)
        for remote in self.remote:
            theirs = remote.models(now)
            engines += tuple(e for e in remote.engines(now) if e.model in models)
            for model, n in theirs.items():
                if model in models:
                    models[model] += n
                elif model not in self._unknown_models:
                    self._unknown_models.add(model)
                    log.warning("engine host %s serves %s, which is not served here (give it as --model): its "
                                "engines are not used", remote.url, model)
        return engines, models

    def _remote_pausing(self, now: float) -> str:
        """The pausing phase of an engine host that answers ("" when none pauses)."""
        return next((p for r in self.remote if (p := r.phase(now)) in PAUSING_PHASES), "")

    def _pump_remote(self, remote: RemoteEngines) -> None:
        if remote.pump():
            self._publish()

    def _broadcast(self) -> None:
        msg = ClusterUpdate(self.store.get())
        for c in self._live("gateway"):
            c.send(msg)

    def reconcile(self) -> None:
        now = time.monotonic()
        for remote in self.remote:
            remote.tick(now)
            remote.pump()  # (a send may take the descriptor's edge of a reply that came meanwhile)
            remote.applied_by_gateways(self._lagging, now)
        if self.registry is not None:
            self.registry.pump()
        self._reap(now)
        self._check_hung(now)
        if not self.stopping:
            self._match_counts(now)
            for group in self.elastic.values():
                group.tick(now)
            if self.reloading is not None:
                self.reloading.tick(now)
                if self.reloading.done:
                    self.reloading = None
            self._check_tiers(now)
        self._publish()
        if self.shared is not None:
            self._follow_shared(now)
        if self.control is not None:
            self.control.answer_pending(self._lagging_anywhere)
        self._watchdog(now)

    def _watchdog(self, now: float) -> None:
        interval = systemd.watchdog_interval()
        if interval and now - self._last_watchdog >= interval:
            systemd.notify("WATCHDOG=1")
            self._last_watchdog = now

    # -- lifecycle ---------------------------------------------------------------------------
    def _open_tiers_across_hosts(self) -> None:
        """An engine host's registry, or a gateway host's connections to its engine hosts."""
        c = self.cfg
        keys = CurveKeys.load(c.keys_dir) if c.keys_dir else None
        if c.bind is not None:
            self.registry = RegistryServer(c.bind, keys, c.heartbeat_timeout)
            self.sel.register(self.registry.fileno(), selectors.EVENT_READ, self.registry.pump)
            self.url = c.bind
            self.pointer = control.pointer_path(tcp_port(c.bind))
        for url in c.remote_engines:
            remote = RemoteEngines(url, keys, c.heartbeat_interval, c.heartbeat_timeout)
            self.remote.append(remote)
            self.sel.register(remote.fileno(), selectors.EVENT_READ, partial(self._pump_remote, remote))
        if c.bind is None and is_redis(c.gateway.state_url):
            assert c.gateway.state_url is not None
            self.shared = SharedControl(c.gateway.state_url, self._wake, c.heartbeat_interval)
        if keys is None and (c.bind is not None or c.remote_engines):
            for _ in range(3):  # loudly, at every start
                log.warning("--insecure: engine traffic over TCP (%s) is neither encrypted nor authenticated; anyone "
                            "who reaches these ports can use or impersonate the engines", c.bind or
                            ", ".join(c.remote_engines))

    def start(self) -> str:
        t0 = time.monotonic()
        self._make_run_dir()
        if warning := no_cache_warning():  # a unit with ProtectSystem=strict and no CacheDirectory=, say
            log.warning("%s", warning)
        self.control_path = os.path.join(self.run_dir, "control.sock")
        self.control = ControlServer(self.control_path, self.sel, self.command)
        self.sel.register(self._signal_r, selectors.EVENT_READ, self._read_signals)
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD, signal.SIGTTIN, signal.SIGTTOU):
            signal.signal(s, self._on_signal)
        self._open_tiers_across_hosts()
        if self.cfg.bind is None:
            self.listener = systemd.inherited_listener() or (
                create_unix_listener(self.cfg.uds) if self.cfg.uds else create_listener(self.cfg.host, self.cfg.port))
        if self.listener is None:
            pass  # an engine host: no HTTP
        elif self.listener.family == socket.AF_UNIX:
            path = self.listener.getsockname()
            self._uds_inode = os.stat(path).st_ino  # removed on exit only if still ours
            self.url = f"unix:{path}"
            self.pointer = control.pointer_path(path)
        else:
            host, port = self.listener.getsockname()[:2]
            self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
            self.pointer = control.pointer_path(port)
        with open(self.pointer, "w") as f:
            f.write(self.control_path)
        deadline = time.monotonic() + self.cfg.ready_timeout
        if self.render_only:
            log.info("starting %d render-only gateway(s) for %s (no engine)", self.desired["gateway"], self.model_ids)
        elif self.remote:
            log.info("starting %d gateway(s) for %s with the engines of %s", self.desired["gateway"], self.model_ids,
                     ", ".join(r.url for r in self.remote))
        else:
            self.num_gpus = cuda_device_count()
            log.info("%s", f"{self.num_gpus} GPU(s) visible" if self.num_gpus else
                     "no GPU visible: engines run on the CPU")
            log.info("starting %s and %d gateway(s)", " + ".join(f"{t.desired} engine(s) for {t.model_id}"
                                                                 for t in self.tiers), self.desired["gateway"])
        # Both tiers start at once: gateways build their tokenizer while engines load weights.
        while True:
            try:
                self.reconcile()
            except TierFailed as e:
                raise StartupError(str(e)) from None
            if self.stopping:
                raise StartupError("interrupted while starting")
            if (all(len([c for c in live if c.ready]) >= len(wanted) for _, wanted, live in self._wanted())
                    and all(g.serving for g in self.elastic.values()) and self._remote_ready()):
                break
            if time.monotonic() > deadline:
                silent = [r.url for r in self.remote if not r.fresh(time.monotonic())]
                why = f": no answer from the engine host(s) at {', '.join(silent)}" if silent else ""
                raise StartupError(f"not ready within {self.cfg.ready_timeout:.0f}s (--ready-timeout){why}")
            self._poll(0.2)
        # Every gateway follows the final membership (each acknowledges a version only once it reaches the
        # engines that version calls ready), so the first request for any model finds its engine.
        while self._lagging(self.store.get().version) and time.monotonic() < deadline:
            self._poll(0.05)
            self.reconcile()
        n_gw, n_en = self.desired["gateway"], self.engines_desired
        if self.listener is not None:
            self._check_health(deadline)
        if self.remote:
            n_en = len(self.store.get().engines)
            hosts = len(self.remote)
            engines = f"{n_en} engine{'s' * (n_en != 1)} on {hosts} engine host{'s' * (hosts != 1)}"
        else:
            engines = "no engine: render only" if self.render_only else f"{n_en} engine{'s' * (n_en != 1)}"
        print(f"zserve: serving {self.model_ids} at {self.url} ({n_gw} gateway{'s' * (n_gw != 1)}, "
              f"{engines}; ready in {time.monotonic() - t0:.1f}s)", flush=True)
        systemd.notify(f"READY=1\nSTATUS=serving {self.model_ids} at {self.url}")
        return self.url

    def _remote_ready(self) -> bool:
        """A gateway host starts serving once every engine host answered and each model has a ready engine."""
        if not self.remote:
            return True
        now = time.monotonic()
        ready = {e.model for r in self.remote for e in r.engines(now) if e.state == "ready"}
        return all(r.fresh(now) for r in self.remote) and all(t.model_id in ready for t in self.tiers)

    def _check_health(self, deadline: float) -> None:
        while True:
            try:
                if self.url.startswith("unix:"):
                    conn = UnixHTTPConnection(self.url.removeprefix("unix:"))
                    conn.request("GET", "/health")
                    if conn.getresponse().status == 200:
                        return
                    conn.close()
                else:
                    with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                        if r.status == 200:
                            return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise StartupError(f"{self.url}/health did not answer 200")
            self._poll(0.1)

    def run(self) -> int:
        """Serve until told to stop; return the exit code."""
        try:
            while not self.stopping:
                self._poll(self.cfg.heartbeat_interval)
                self.reconcile()
        except TierFailed as e:
            log.error("%s; stopping", e)
            self.exit_code = 1
            self.stopping = True
        return self.exit_code

    def stop(self) -> int:
        """Drain gateways (they finish in-flight requests up to the shutdown timeout), then engines."""
        self.stopping = True
        systemd.notify("STOPPING=1")
        drained = True
        for tier in ("gateway", "engine"):
            kids = self._live(tier)
            for c in kids:
                c.draining = True
                c.signal(signal.SIGKILL if self.fast_stop else signal.SIGTERM)
            deadline = time.monotonic() + self.cfg.shutdown_timeout + 5
            while any(c.alive for c in kids) and time.monotonic() < deadline:
                self._poll(0.1)
                if self.fast_stop:
                    for c in kids:
                        c.signal(signal.SIGKILL)
            for c in kids:
                if c.alive:
                    log.warning("%s did not stop in time; killing it", c.name)
                    c.signal(signal.SIGKILL)
                c.proc.wait()
                if tier == "gateway" and (c.proc.returncode == EXIT_CUT_OFF or c.proc.returncode < 0):
                    drained = False  # requests were cut off, or the gateway had to be killed
            self._reap(time.monotonic())
        if self.control is not None:
            self.control.close()
        if self.shared is not None:
            self.shared.leave()
        for closing in (self.registry, *self.remote):
            if closing is not None:
                closing.close()
        if self.listener is not None:
            if self.listener.family == socket.AF_UNIX:
                _remove_socket_file(self.listener.getsockname(), self._uds_inode)
            self.listener.close()
        try:
            if self.pointer and open(self.pointer).read().strip() == self.control_path:
                os.unlink(self.pointer)
        except OSError:
            pass
        if self.run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.exit_code == 0 and not drained:
            log.warning("some requests were cut off by the shutdown timeout")
            self.exit_code = 1
        return self.exit_code

    # -- status ------------------------------------------------------------------------------
    def status(self) -> StatusReply:
        now = time.monotonic()
        procs = []
        for c in sorted(self.children, key=lambda c: (c.tier, c.index)):
            load = c.load.to_wire() if c.load is not None else {}
            state = c.state if c.alive else "exited"  # (not reaped yet)
            procs.append(ProcessStatus(c.tier, c.index, c.pid, state, restarts=max(0, c.slot.restarts - 1),
                                       crash_looping=c.slot.crash_looping(now), uptime_s=round(now - c.started, 1),
                                       model=self._model_of(c.slot), **load))
        wanted = {(tier, i) for tier, indices, _ in self._wanted() for i in indices}
        for (tier, index), slot in sorted(self.slots.items()):
            if (tier, index) in wanted and not [c for c in self.children if c.slot is slot]:
                procs.append(ProcessStatus(tier, index, None, "backoff", restarts=max(0, slot.restarts - 1),
                                           crash_looping=slot.crash_looping(now), last_exit=slot.last_exit,
                                           next_start_in_s=round(max(0.0, slot.next_start - now), 1),
                                           model=self._model_of(slot)))
        local = {(c.index, self.engine_endpoint(c.index)) for c in self.children if c.tier == "engine"}
        st = self.store.get()
        for e in st.engines:
            if (e.rank, e.endpoint) not in local:  # an engine host's
                procs.append(ProcessStatus("engine", e.rank, e.pid, e.state, 0, False, model=e.model,
                                           endpoint=e.endpoint))
        return StatusReply(url=self.url, models=dict(st.models) or {t.model_id: t.desired for t in self.tiers},
                           pid=os.getpid(), run_dir=self.run_dir, uptime_s=round(time.time() - self.started_at, 1),
                           desired={"gateway": self.desired["gateway"],
                                    "engine": sum(st.models.values()) if st.models else self.engines_desired},
                           paused=st.paused, cluster_version=st.version, processes=tuple(procs),
                           expert_parallel={g.tier.model_id: g.status() for g in self.elastic.values()} or None)

    def _model_of(self, slot: Slot) -> str | None:
        return self.tier_of(slot.index).model_id if slot.tier == "engine" else None
