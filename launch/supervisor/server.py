"""One server: the arbiter and the parts beside it, wired together; start, the loop, stop.

- ``Arbiter`` (``arbiter.py``): the processes, kept at their desired counts.
- ``ClusterPublisher`` (``publisher.py``): the only writer of the cluster state every gateway follows, and where
  their acknowledgements count; its ``Admission`` (``admission.py``) decides the holds on each model's requests.
- ``ControlServer`` (``launch.control_server``) and ``Commands`` (``commands.py``): the owner-only control socket
  and what each command does.
- operations (``launch.ops``): each expert-parallel tier's ``ElasticGroup``, a ``RollingRestart``; state machines
  that see the others only through ``launch.interfaces``.
- other hosts (``launch.hosts``): an engine host's registry, a gateway host's engine hosts, the shared state of
  gateway hosts in Redis.

Children run in their own session with a parent-death signal, so the terminal's Ctrl-C reaches only the
supervisor and ``kill -9`` of the supervisor takes every child with it. Each model served has its own engine tier
(``ModelTier``). A render server (``launch render``) is the same loop with no engines at all; an engine host
(``launch engine``) is this loop with no gateways, serving its engines' membership to gateway hosts; a gateway host
(``launch api-server --engine tcp://…``) is this loop with no local engines.
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
from dataclasses import fields
from functools import partial

from gateway.quota import Rules, usage_now
from gateway.security import write_key_file
from protocol.cluster import EngineInfo, EngineState
from protocol.constants import EXIT_CUT_OFF
from protocol.control import (
    AbortReport,
    ControlMessage,
    EngineCondition,
    EngineOpReport,
    GroupReport,
    LoraReport,
    OperationCommand,
    OperationReply,
    RemoteOperationReply,
)
from zserve import control
from zserve.curve import CurveKeys, tcp_port
from zserve.devices import cuda_device_count, engine_device
from zserve.paths import no_cache_warning, user_cache_dir
from zserve.tenants import Tenants, TenantsError, load_tenants

from .. import handoff, systemd, zygote
from ..children import Child, Slot, spawn, start_zygote
from ..control_server import ControlServer, Later
from ..hosts.engine_registry import RegistryServer, RemoteEngines
from ..hosts.shared_state import SharedControl, is_redis
from ..ops.aborts import Aborts
from ..ops.elastic import ElasticGroup
from ..ops.engine_ops import EngineOperations
from ..ops.lora import LoraAdapters
from ..ops.reload import RollingRestart
from ..sockets import UnixHTTPConnection, create_listener, create_unix_listener
from ..tiers import ServeConfig, model_tiers
from .arbiter import Arbiter, ArbiterHooks, TierFailed
from .commands import Commands
from .publisher import ClusterPublisher

log = logging.getLogger("zserve.launch")
ZYGOTE_RETRY_S = 60.0

EXIT_SUPERVISOR_FAILED = 70
"""launch's exit code when the supervisor itself failed (an unexpected exception, a bug: its traceback is in the
log); its children were stopped as at SIGTERM. sysexits' EX_SOFTWARE, so systemd's Restart=on-failure restarts it."""


class StartupError(RuntimeError):
    pass


def _remove_socket_file(path: str, inode: int | None) -> None:
    """Unlink a ``--uds`` socket's file, unless another server has bound the path since (another inode)."""
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except OSError:
        pass


class Supervisor:
    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.tiers = model_tiers(cfg)
        self.arbiter = Arbiter(cfg, self.tiers, ArbiterHooks(
            start=self._start_child, event=self._on_event, died=self._on_death, draining=self._publish,
            reload=self.reload))
        self.publisher = ClusterPublisher(self._membership, lambda: self.arbiter.live("gateway"), self._phase,
                                          lambda: self.loras.state(), lambda: self.loras.errors(),
                                          lambda: self.operations.state())
        # The LoRA adapters served and wanted (engine hosts' engines: through their registries).
        self.loras = LoraAdapters(self.arbiter, self.publisher, self.tiers, cfg.lora_dirs,
                                  self.publisher.remote_lora_errors)
        self.admission = self.publisher.admission
        # Engine operations (sleep, weights, caches, profiling) and aborts, from any gateway.
        self.operations = EngineOperations(self.arbiter, self.publisher, self.admission, self.tiers, cfg.profiler_dir,
                                           self._operation_busy, lambda: self.publisher.remote)
        self._remote_ops: list[tuple[bytes, int, Later]] = []  # an engine host's operations for gateway hosts
        self.aborts = Aborts(self.arbiter, lambda: self.shared)
        self.sel = self.arbiter.sel
        self.listener: socket.socket | None = None
        self.zygotes: dict[str, zygote.Zygote] = {}  # each child module's (launch.zygote), started with the tiers
        self._zygote_replaced: dict[str, float] = {}  # when each module's zygote was last replaced
        self.control: ControlServer | None = None
        self.control_path = self.pointer = self.url = ""
        self.started_at = time.time()
        self.exit_code = 0
        self._last_watchdog = 0.0
        self._uds_inode: int | None = None
        self.serving = False  # start() is over: an engine started from now on loads the adapters served now
        # Expert-parallel tiers (by their first rank): each one group, formed, resized and re-formed here.
        self.elastic = {t.base: ElasticGroup(self.arbiter, self.publisher, self.admission, t)
                        for t in self.tiers if t.spec.engine.expert_parallel}
        self.reloading: RollingRestart | None = None  # SIGHUP / launch reload in progress
        self.tenants = Tenants()  # the tenants in force (--tenants; zserve.tenants)
        self.shared: SharedControl | None = None  # the control state of every gateway host (--state-url redis)
        self.commands = Commands(self)
        self.loras.share, self.loras.shared_behind = self.commands.share_loras, self.commands.shared_behind

    # -- what the parts ask ------------------------------------------------------------------------------------
    @property
    def render_only(self) -> bool:
        """A server without engines (launch render): gateways render requests and never generate."""
        return not self.cfg.remote_engines and all(spec.engines == 0 for _, spec in self.cfg.models)

    @property
    def run_dir(self) -> str:
        return self.arbiter.run_dir

    @property
    def model_ids(self) -> str:
        return ", ".join(t.model_id for t in self.tiers)

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

    def group_of(self, child: Child) -> ElasticGroup | None:
        return self.elastic.get(self.arbiter.tier_of(child.index).base) if child.tier == "engine" else None

    @property
    def quota_dir(self) -> str:
        """Where this host's gateways keep each tenant's limits (``gateway.quota``)."""
        return os.path.join(self.run_dir, "quota")

    def tenant_usage(self) -> list[dict]:
        """Each tenant's limits beside its buckets' levels and requests in flight now (``launch status --tenants``):
        Redis's with ``--state-url redis://``, else this host's."""
        rows = []
        for t in self.tenants.tenants:
            use = usage_now(self.quota_dir, self.cfg.gateway.state_url, t.name, Rules.of(t)) if t.limited else {}
            rows.append({"name": t.name, "requests_per_minute": t.requests_per_minute,
                         "tokens_per_minute": t.tokens_per_minute, "max_concurrent": t.max_concurrent,
                         "weight": t.weight, "priority": t.priority, "models": t.models, "admin": t.admin, **use})
        return rows

    def reload_tenants(self) -> tuple[str | None, int]:
        """Read the tenants file again: written to the key file and applied by every gateway (the cluster state's
        ``keys_version``). A malformed file is refused and the tenants in force stay: (why, 0); else (None, the
        cluster-state version every gateway must apply)."""
        if self.cfg.tenants is None:
            return None, self.publisher.publish()
        try:
            tenants = load_tenants(self.cfg.tenants)
        except TenantsError as e:
            log.error("reload: the tenants file is refused, the tenants in force stay: %s", e)
            return str(e), 0
        write_key_file(self.key_file, self.cfg.api_keys, self.cfg.admin_keys, tenants)
        self.tenants = tenants
        self.publisher.keys_version += 1
        log.info("reload: %d tenant(s) from %s", len(tenants.tenants), self.cfg.tenants)
        return None, self.publisher.publish()

    def reload(self, tenants: bool = True) -> RollingRestart:
        """Start a rolling restart (``launch.ops.reload``), or join the one in progress; with ``tenants``, the
        tenants file is read again first (SIGHUP: a malformed one is logged, and the rolling restart goes on with the
        tenants in force)."""
        if self.reloading is None:
            if tenants:
                self.reload_tenants()
            self.reloading = RollingRestart.begin(self.arbiter, self.publisher, self.admission, self.tiers)
        else:
            log.info("reload: one is in progress already")
        return self.reloading

    # -- the arbiter's hooks -----------------------------------------------------------------------------------
    def _start_child(self, slot: Slot) -> Child:
        c, a, index = self.cfg, self.arbiter, slot.index
        if slot.tier == "engine":
            mt = a.tier_of(index)
            group = self.elastic.get(mt.base)
            loras = self.loras.spawn_set(mt.model_id) if self.serving and mt.spec.engine.enable_lora else None
            source, version = self.operations.spawn_weights(mt)
            engine = handoff.engine_launch(
                index, a.engine_endpoint(index), source, mt.spec.engine, threads=a.engine_threads(),
                device=engine_device(mt.first_device + index - mt.base, a.num_gpus),
                heartbeat_interval=c.heartbeat_interval, shutdown_timeout=c.shutdown_timeout,
                expert_share=group.share(index) if group else None,
                keys_dir=c.keys_dir if c.bind is not None else None, loras=loras, weight_version=version,
                kv_events=a.kv_events_endpoint(index))
            return spawn(slot, "engine_worker", handoff.argv(engine), zygote=self._zygote("engine_worker"),
                         wait=not self.serving)
        assert self.listener is not None
        fd = self.listener.fileno()
        gateway = handoff.gateway_launch(
            index, fd, [(t.source, t.names, t.loras) for t in self.tiers], c.gateway, render_only=self.render_only,
            cache_dir=self.cache_dir, control_socket=self.control_path, shutdown_timeout=c.shutdown_timeout,
            heartbeat_interval=c.heartbeat_interval, responses_db=os.path.join(self.run_dir, "responses.db"),
            key_file=self.key_file if c.api_keys or c.admin_keys or c.tenants else None,
            quota_dir=self.quota_dir if c.tenants else None, keys_dir=c.keys_dir if c.remote_engines else None)
        child = spawn(slot, "gateway", handoff.argv(gateway), pass_fds=(fd,), env=self._gateway_env(),
                      zygote=self._zygote("gateway"), wait=not self.serving)
        self.publisher.welcome(child)
        return child

    def _gateway_env(self) -> dict[str, str]:
        return {"PROMETHEUS_MULTIPROC_DIR": os.path.join(self.run_dir, "metrics")}

    def _start_zygotes(self) -> None:
        """A zygote for each tier this host runs (``launch.zygote``: children forked with their imports done), this
        process their subreaper; none with ZSERVE_PRELOAD=0 or where a subreaper cannot be had."""
        if not zygote.enabled() or not zygote.become_subreaper():
            return
        if self.arbiter.desired["gateway"]:
            self._new_zygote("gateway")
        if not self.render_only and not self.publisher.remote:
            self._new_zygote("engine_worker")

    def _new_zygote(self, module: str) -> zygote.Zygote:
        self.zygotes[module] = start_zygote(module, self._gateway_env() if module == "gateway" else None)
        return self.zygotes[module]

    def _zygote(self, module: str) -> zygote.Zygote | None:
        """``module``'s zygote. One that died is replaced, unless it was itself a replacement started within
        ZYGOTE_RETRY_S (a zygote that cannot live costs each start the fresh interpreter it would have had, never a
        loop); while a new one imports, children start fresh rather than wait for it (after the server's start)."""
        z = self.zygotes.get(module)
        if z is None or z.alive:
            return z
        now = time.monotonic()
        if now - self._zygote_replaced.get(module, -ZYGOTE_RETRY_S) < ZYGOTE_RETRY_S:
            return None
        self._zygote_replaced[module] = now
        z.close()
        log.warning("the zygote of the %s tier is gone (exit code %s); starting a new one", module,
                    z.proc.returncode)
        return self._new_zygote(module)

    def _on_event(self, child: Child, msg: ControlMessage) -> None:
        group = self.group_of(child)
        if isinstance(msg, GroupReport) and group is not None:
            group.on_report(child, msg)
        elif isinstance(msg, LoraReport) and child.tier == "engine":
            self.loras.on_report(child, msg)
            self._publish()
        elif isinstance(msg, EngineOpReport) and child.tier == "engine":
            self.operations.on_report(child, msg)
        elif isinstance(msg, EngineCondition) and child.tier == "engine":
            self.operations.on_condition(child, msg)
            self._publish()
        elif isinstance(msg, AbortReport) and child.tier == "gateway":
            self.aborts.on_report(child, msg)

    def _on_death(self, child: Child, why: str) -> bool:
        group = self.group_of(child)
        return group is not None and group.on_death(child, why)

    # -- the cluster state -------------------------------------------------------------------------------------
    def _engine_state(self, c: Child) -> EngineState:
        """What gateways are told of an engine: an expert-parallel one is ready only inside its serving group."""
        group = self.group_of(c)
        if group is not None and c.state == EngineState.READY and not group.serves(c.index):
            return EngineState.STARTING
        return c.state

    def _membership(self) -> tuple[tuple[EngineInfo, ...], dict[str, int], int, int]:
        a = self.arbiter
        live = sorted(a.live("engine"), key=lambda c: c.index)
        engines = tuple(EngineInfo(c.index, a.engine_endpoint(c.index), self._engine_state(c), c.pid,
                                   a.tier_of(c.index).model_id, c.loras or (),
                                   c.condition.sleeping if c.condition else 0,
                                   c.condition.version if c.condition else "", a.kv_events_endpoint(c.index))
                        for c in live)
        return engines, {t.model_id: t.desired for t in self.tiers}, a.desired["gateway"], a.engines_desired

    def _phase(self) -> str:
        """The expert-parallel phase the cluster state shows: the first group's that is doing anything."""
        return next((g.phase for g in self.elastic.values() if g.phase), "")

    def _follow_remote_operations(self) -> None:
        """An engine host carries out the engine operations its gateway hosts ask for, and answers each."""
        registry = self.publisher.registry
        if registry is None:
            return
        for who, msg in registry.take_operations():
            answer = self.operations.request(OperationCommand(msg.op, msg.model, msg.args), Later())
            self._remote_ops.append((who, msg.id, answer))
        for item in list(self._remote_ops):
            who, i, answer = item
            if isinstance(answer.reply, OperationReply):
                reply = answer.reply
                registry.answer(who, RemoteOperationReply(**{f.name: getattr(reply, f.name) for f in fields(reply)},
                                                          id=i))
                self._remote_ops.remove(item)

    def _operation_busy(self, model: str) -> str | None:
        """Why ``model`` takes no engine operation now: a resize or a rolling restart changes its engines."""
        if self.reloading is not None:
            return "is being restarted (a rolling restart)"
        if any(self.admission.holding(reason, model) for reason in ("resizing", "reloading")):
            return "is resizing its engine group"
        return None

    def _publish(self) -> int:
        return self.publisher.publish()

    def _follow_failures(self) -> None:
        """The admission owner refuses the requests of the models the arbiter found failed (and only theirs)."""
        for t in self.tiers:
            failed = self.arbiter.failed.get(t.model_id)
            if failed is not None:
                self.admission.hold("failed", t.model_id, failed)
            elif self.admission.holding("failed", t.model_id):
                self.admission.release("failed", t.model_id)

    def _follow_loras(self, now: float) -> None:
        """LoRA adapters across hosts: an engine host's engines load what its gateway hosts want; a gateway host
        asks its engine hosts for what its cluster wants."""
        if self.publisher.registry is not None:
            self.loras.follow(self.publisher.registry.wanted_loras())
        wanted = self.loras.wanted()
        for remote in self.publisher.remote:
            remote.want_loras(wanted, now)
        self.loras.tick(now)

    def reconcile(self) -> None:
        now = time.monotonic()
        self.publisher.tick(now)
        self.arbiter.turn(now)
        if self.zygotes:  # (a subreaper: descendants orphaned to it are its children to reap)
            zygote.reap_orphans({c.pid for c in self.arbiter.children} | {z.proc.pid for z in self.zygotes.values()})
        if not self.arbiter.stopping:
            for group in self.elastic.values():
                group.tick(now)
            if self.reloading is not None:
                self.reloading.tick(now)
                if self.reloading.done:
                    self.reloading = None
            self._follow_failures()
            self._follow_loras(now)
            self._follow_remote_operations()
            self.operations.tick(now)
            self.aborts.tick(now)
        self.publisher.publish()
        if self.shared is not None:
            self.commands.follow_shared(now)
        if self.control is not None:
            self.control.answer_pending(self.commands.lagging_anywhere)
        self._watchdog(now)

    def _watchdog(self, now: float) -> None:
        interval = systemd.watchdog_interval()
        if interval and now - self._last_watchdog >= interval:
            systemd.notify("WATCHDOG=1")
            self._last_watchdog = now

    # -- lifecycle ---------------------------------------------------------------------------------------------
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
        self.arbiter.run_dir = tempfile.mkdtemp(prefix="run-", dir=base)
        with open(os.path.join(self.run_dir, "supervisor.pid"), "w") as f:
            f.write(str(os.getpid()))
        os.makedirs(os.path.join(self.run_dir, "metrics"), exist_ok=True)
        if self.cfg.tenants:
            os.makedirs(self.quota_dir, mode=0o700, exist_ok=True)
        if self.cfg.tenants:  # (the file was checked at start: one made unreadable since stops the start here)
            self.tenants = load_tenants(self.cfg.tenants)
        if self.cfg.api_keys or self.cfg.admin_keys or self.cfg.tenants:
            write_key_file(self.key_file, self.cfg.api_keys, self.cfg.admin_keys, self.tenants)

    def _open_tiers_across_hosts(self) -> None:
        """An engine host's registry, or a gateway host's connections to its engine hosts."""
        c, p = self.cfg, self.publisher
        keys = CurveKeys.load(c.keys_dir) if c.keys_dir else None
        if c.bind is not None:
            p.registry = RegistryServer(c.bind, keys, c.heartbeat_timeout)
            self.sel.register(p.registry.fileno(), selectors.EVENT_READ, p.registry.pump)
            self.url = c.bind
            self.pointer = control.pointer_path(tcp_port(c.bind))
        for url in c.remote_engines:
            remote = RemoteEngines(url, keys, c.heartbeat_interval, c.heartbeat_timeout)
            p.remote.append(remote)
            self.sel.register(remote.fileno(), selectors.EVENT_READ, partial(p.pump_remote, remote))
        if c.bind is None and is_redis(c.gateway.state_url):
            assert c.gateway.state_url is not None
            self.shared = SharedControl(c.gateway.state_url, self.arbiter.wake, c.heartbeat_interval)
        if keys is None and (c.bind is not None or c.remote_engines):
            for _ in range(3):  # loudly, at every start
                log.warning("--insecure: engine traffic over TCP (%s) is neither encrypted nor authenticated; anyone "
                            "who reaches these ports can use or impersonate the engines", c.bind or
                            ", ".join(c.remote_engines))

    def _open_listener(self) -> None:
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

    def _started(self) -> bool:
        """Every wanted process ready (a failed model's excepted), every group serving, every engine host heard."""
        failed = self.arbiter.failed
        return (all(len([c for c in live if c.ready]) >= len(wanted) for tier, wanted, live in self.arbiter.wanted()
                    if not (tier == "engine" and wanted and self.arbiter.tier_of(wanted[0]).model_id in failed))
                and all(g.serving for g in self.elastic.values())
                and (not self.publisher.remote or self.publisher.remote_ready([t.model_id for t in self.tiers])))

    def start(self) -> str:
        t0 = time.monotonic()
        a = self.arbiter
        self._make_run_dir()
        if warning := no_cache_warning():  # a unit with ProtectSystem=strict and no CacheDirectory=, say
            log.warning("%s", warning)
        self.control_path = os.path.join(self.run_dir, "control.sock")
        self.control = ControlServer(self.control_path, self.sel, self.commands.dispatch)
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD, signal.SIGTTIN, signal.SIGTTOU):
            signal.signal(s, a.on_signal)
        self._open_tiers_across_hosts()
        self._open_listener()
        self._start_zygotes()
        deadline = time.monotonic() + self.cfg.ready_timeout
        n_gw = a.desired["gateway"]
        if self.render_only:
            log.info("starting %d render-only gateway(s) for %s (no engine)", n_gw, self.model_ids)
        elif self.publisher.remote:
            log.info("starting %d gateway(s) for %s with the engines of %s", n_gw, self.model_ids,
                     ", ".join(r.url for r in self.publisher.remote))
        else:
            a.num_gpus = cuda_device_count()
            log.info("%s", f"{a.num_gpus} GPU(s) visible" if a.num_gpus else "no GPU visible: engines run on the CPU")
            log.info("starting %s and %d gateway(s)", " + ".join(f"{t.desired} engine(s) for {t.model_id}"
                                                                 for t in self.tiers), n_gw)
        # Both tiers start at once: gateways build their tokenizer while engines load weights.
        while True:
            try:
                self.reconcile()
            except TierFailed as e:
                raise StartupError(str(e)) from None
            if a.stopping:
                raise StartupError("interrupted while starting")
            if self._started():
                break
            if time.monotonic() > deadline:
                silent = [r.url for r in self.publisher.remote if not r.fresh(time.monotonic())]
                why = f": no answer from the engine host(s) at {', '.join(silent)}" if silent else ""
                raise StartupError(f"not ready within {self.cfg.ready_timeout:.0f}s (--ready-timeout){why}")
            a.poll(0.2)
        # Every gateway follows the final membership (each acknowledges a version only once it reaches the
        # engines that version calls ready), so the first request for any model finds its engine.
        while self.publisher.lagging(self.publisher.version) and time.monotonic() < deadline:
            a.poll(0.05)
            self.reconcile()
        if self.listener is not None:
            self._check_health(deadline)
        n_en = a.engines_desired
        if self.publisher.remote:
            n_en = len(self.publisher.state.engines)
            hosts = len(self.publisher.remote)
            engines = f"{n_en} engine{'s' * (n_en != 1)} on {hosts} engine host{'s' * (hosts != 1)}"
        else:
            engines = "no engine: render only" if self.render_only else f"{n_en} engine{'s' * (n_en != 1)}"
        self.serving = True
        print(f"zserve: serving {self.model_ids} at {self.url} ({n_gw} gateway{'s' * (n_gw != 1)}, "
              f"{engines}; ready in {time.monotonic() - t0:.1f}s)", flush=True)
        systemd.notify(f"READY=1\nSTATUS=serving {self.model_ids} at {self.url}")
        return self.url

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
            self.arbiter.poll(0.1)

    def run(self) -> int:
        """Serve until told to stop; return the exit code."""
        try:
            while not self.arbiter.stopping:
                self.arbiter.poll(self.cfg.heartbeat_interval)
                self.reconcile()
        except TierFailed as e:
            log.error("%s; stopping", e)
            self.exit_code = 1
            self.arbiter.stopping = True
        return self.exit_code

    def stop(self) -> int:
        """Drain gateways (they finish in-flight requests up to the shutdown timeout), then engines."""
        a = self.arbiter
        a.stopping = True
        systemd.notify("STOPPING=1")
        drained = True
        for tier in ("gateway", "engine"):
            kids = a.live(tier)
            for c in kids:
                c.draining = True
                c.signal(signal.SIGKILL if a.fast_stop else signal.SIGTERM)
            deadline = time.monotonic() + self.cfg.shutdown_timeout + 5
            while any(c.alive for c in kids) and time.monotonic() < deadline:
                a.poll(0.1)
                if a.fast_stop:
                    for c in kids:
                        c.signal(signal.SIGKILL)
            for c in kids:
                if c.alive:
                    log.warning("%s did not stop in time; killing it", c.name)
                    c.signal(signal.SIGKILL)
                c.proc.wait()
                if tier == "gateway" and (c.proc.returncode == EXIT_CUT_OFF or c.proc.returncode < 0):
                    drained = False  # requests were cut off, or the gateway had to be killed
            a.reap(time.monotonic())
        for z in self.zygotes.values():
            z.close()
        if self.control is not None:
            self.control.close()
        if self.shared is not None:
            self.shared.leave()
        for closing in (self.publisher.registry, *self.publisher.remote):
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



