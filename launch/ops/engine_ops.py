"""Engine operations as cluster state: sleep and wake, weight updates, cache resets and profiling, asked through any
gateway (``OperationCommand``), carried out by every engine of the model, answered once all have done it.

The supervisor owns what the engines of each model should be: asleep or not (``sleeping``: model → level, in the
cluster state with a "sleeping" hold on the model's requests) and which weights they serve (``weights``: model →
checkpoint and version label). An operation is a generator the loop turns (``tick``): it yields a condition, and
goes on once it holds — every engine answered (``EngineOpReport``), every gateway applied a cluster-state version.

- **sleep**: hold the model's new requests (they wait up to --scaling-wait, then 503), then every engine finishes
  its started requests and frees its KV cache and, by level, its weights. One engine failing wakes the others.
- **wake_up**: every engine brings back what the tags name; once nothing is asleep the hold is released.
- **update_weights**: every engine reads the new checkpoint beside the served one (``stage_weights``); one refusal
  and all drop it (nothing changed anywhere, 400). Then the model's requests are held, every engine finishes the
  requests it started on the old weights and swaps (``commit_weights``), and the hold is released: each response
  comes wholly from the old weights or wholly from the new.
- **reset_prefix_cache** and the others: every engine does it, and says what it did.

Engines that start later are given the model's current weights in their launch value (``spawn_weights``) and are
put to sleep as soon as they report, when their model sleeps. A gateway host (its engines on engine hosts) sends the
operation to every engine host serving the model (``RemoteOperation``), which carries it out as its own and answers
with its engines' results; the engine host's holds reach the gateway host's gateways through its registry.

A state machine the supervisor's loop turns; it sees the processes, the publisher and the admission owner only
through ``launch.interfaces``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace

from protocol.cluster import EngineState
from protocol.control import (
    SLEEP_LEVELS,
    WAKE_TAGS,
    EngineCondition,
    EngineOp,
    EngineOpReport,
    OperationCommand,
    OperationReply,
    RemoteOperation,
)
from zserve.catalog import ModelSource

from ..children import Child
from ..control_server import ACK_TIMEOUT, Later
from ..interfaces import Holds, Processes, Publisher
from ..tiers import ModelTier

log = logging.getLogger("zserve.launch")

ENGINE_TIMEOUT = 300.0  # seconds every engine has for one step of an operation (a sleep waits for its requests)
REMOTE_TIMEOUT = 3 * ENGINE_TIMEOUT  # seconds an engine host has for a whole operation (an update has three steps)
OUTCOME_ORDER = ("failed", "busy", "invalid", "not_found", "ok")  # the worst of several engine hosts' outcomes
DEFAULT_VERSION = "default"

Condition = Callable[[float], bool]
Steps = Generator[Condition, None, None]


class Refused(Exception):
    """An operation that cannot be carried out as asked: ``outcome`` is its OPERATION_OUTCOMES key."""

    def __init__(self, message: str, outcome: str = "invalid"):
        super().__init__(message)
        self.outcome = outcome


@dataclass
class _Op:
    cmd: OperationCommand
    tiers: list[ModelTier]
    answer: Later
    started: float
    steps: Steps | None = None
    waiting: Condition | None = None
    results: dict[int, dict] = field(default_factory=dict)  # engine rank -> what it reported
    pause_started: float | None = None
    pause_s: float | None = None
    version: int = 0
    unacked: list[str] = field(default_factory=list)

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(t.model_id for t in self.tiers)


class EngineOperations:
    def __init__(self, processes: Processes, publisher: Publisher, holds: Holds, tiers: list[ModelTier],
                 profiler_dir: str | None = None, busy: Callable[[str], str | None] = lambda model: None,
                 remote: Callable[[], list] = list):
        self.processes = processes
        self.publisher = publisher
        self.holds = holds
        self.tiers = tiers
        self.profiler_dir = profiler_dir
        self.busy = busy  # why a model cannot take an operation now (a resize, a rolling restart), or None
        self.remote = remote  # a gateway host's engine hosts (``RemoteEngines``): its engines are theirs
        self.sleeping: dict[str, int] = {}  # model id -> level
        self.weights: dict[str, tuple[ModelSource, str]] = {}  # model id -> the weights served, once updated
        self.running: list[_Op] = []
        self._ids = 0
        self._sent: dict[int, tuple[_Op, int]] = {}  # EngineOp id -> (its operation, the engine's rank)

    # -- what the others read ------------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, int], dict[str, str]]:
        """What the cluster state says: the models asleep (level), and each model's weight version."""
        return dict(self.sleeping), {t.model_id: self.version_of(t.model_id) for t in self.tiers}

    def version_of(self, model: str) -> str:
        served = self.weights.get(model)
        return served[1] if served is not None else DEFAULT_VERSION

    def spawn_weights(self, tier: ModelTier) -> tuple[ModelSource, str]:
        """The weights an engine of ``tier`` that starts now reads, and their version label."""
        return self.weights.get(tier.model_id, (tier.source, DEFAULT_VERSION))

    def on_condition(self, child: Child, msg: EngineCondition) -> None:
        child.condition = msg

    def on_report(self, child: Child, msg: EngineOpReport) -> None:
        sent = self._sent.pop(msg.id, None)
        if sent is None:
            return
        op, rank = sent
        entry = {"engine": rank, "model": self._model_of(rank), "ok": msg.ok, **(msg.result or {})}
        if msg.error is not None:
            entry.update(error=msg.error, busy=msg.busy)
        op.results[rank] = entry

    # -- the command ---------------------------------------------------------------------------------------
    def request(self, cmd: OperationCommand, answer: Later) -> Later:
        hosts = self.remote()
        try:
            tiers = self._tiers(cmd.model, every=bool(hosts))
            for t in tiers:
                if any(cmd.op != "stop_profile" and t in o.tiers for o in self.running):
                    raise Refused(f"another operation runs on model {t.model_id!r}; retry once it is over", "busy")
                why = self.busy(t.model_id)
                if why is not None:
                    raise Refused(f"model {t.model_id!r} {why}; retry once it is over", "busy")
            steps = self._steps(cmd, tiers, local=not hosts)
            if hosts:
                steps = lambda op: self._on_hosts(op, hosts)  # noqa: E731 - (checked above, carried out there)
        except Refused as e:
            answer.set(OperationReply(e.outcome, str(e), cmd.op))
            return answer
        op = _Op(cmd, tiers, answer, time.monotonic())
        op.steps = steps(op)
        self.running.append(op)
        self._advance(op, time.monotonic())
        return answer

    def _steps(self, cmd: OperationCommand, tiers: list[ModelTier], local: bool = True) -> Callable[[_Op], Steps]:
        """Check ``cmd``'s arguments (``Refused``) and choose its steps. What only the engines' host can check (a
        weights path, its --profiler-dir) is checked where they run (``local``)."""
        args = dict(cmd.args or {})
        if cmd.op == "sleep":
            level = args.get("level", 1)
            if level not in SLEEP_LEVELS or isinstance(level, bool):
                raise Refused(f"level must be one of {', '.join(map(str, SLEEP_LEVELS))}")
            return lambda op: self._sleep(op, level)
        if cmd.op == "wake_up":
            tags = args.get("tags") or list(WAKE_TAGS)
            if not isinstance(tags, list) or not tags or any(t not in WAKE_TAGS for t in tags):
                raise Refused(f"tags must be a list of {', '.join(WAKE_TAGS)}")
            return lambda op: self._wake(op, tuple(dict.fromkeys(tags)))
        if cmd.op == "update_weights":
            path, version = args.get("path"), args.get("version")
            if not isinstance(path, str) or not path or "\0" in path:
                raise Refused("path must be a checkpoint directory (or .gguf file)")
            if version is not None and not (isinstance(version, str) and 0 < len(version) <= 256):
                raise Refused("version must be a label of 1..256 characters")
            if local and not os.path.exists(path):
                raise Refused(f"the weights path {path!r} does not exist")
            if len(tiers) != 1:
                raise Refused("name the model whose weights to update")
            label = version or os.path.basename(os.path.normpath(path)) or path
            return lambda op: self._update(op, os.path.abspath(path), label)
        if cmd.op == "update_weight_version":
            version = args.get("version")
            if not (isinstance(version, str) and 0 < len(version) <= 256):
                raise Refused("version must be a label of 1..256 characters")
            return lambda op: self._relabel(op, version)
        if cmd.op in ("start_profile", "stop_profile"):
            if local and not self.profiler_dir:
                raise Refused("profiling is off: start the server with --profiler-dir DIR (where each engine "
                              "writes its trace)")
            extra = {"dir": self.profiler_dir} if cmd.op == "stop_profile" else {
                "record_shapes": bool(args.get("record_shapes"))}
            return lambda op: self._each(op, cmd.op, extra)
        if cmd.op == "reset_prefix_cache":
            return lambda op: self._each(op, cmd.op, {"reset_running": bool(args.get("reset_running"))})
        return lambda op: self._each(op, cmd.op, {})  # reset_mm_cache, reset_encoder_cache

    # -- the steps -------------------------------------------------------------------------------------------
    def _each(self, op: _Op, name: str, args: dict) -> Steps:
        yield from self._on_engines(op, name, args)
        self._finish(op)

    def _sleep(self, op: _Op, level: int) -> Steps:
        for t in op.tiers:
            op.version = self.holds.hold("sleeping", t.model_id, f"level {level}")
        op.pause_started = time.monotonic()
        yield from self._acks(op)
        failed = yield from self._on_engines(op, "sleep", {"level": level})
        if failed:
            yield from self._on_engines(op, "wake_up", {"tags": list(WAKE_TAGS)}, record=False)
            for t in op.tiers:
                if t.model_id not in self.sleeping:
                    op.version = self.holds.release("sleeping", t.model_id)
            self._finish(op, "failed", f"sleep failed on {failed}; the engines were woken again")
            return
        for t in op.tiers:
            self.sleeping[t.model_id] = max(level, self.sleeping.get(t.model_id, 0))
        op.version = self.publisher.publish()
        yield from self._acks(op)
        self._finish(op)

    def _wake(self, op: _Op, tags: tuple[str, ...]) -> Steps:
        failed = yield from self._on_engines(op, "wake_up", {"tags": list(tags)})
        if failed:
            self._finish(op, "failed", f"wake_up failed on {failed}")
            return
        for t in op.tiers:
            if not any(r.get("sleeping") for r in op.results.values() if r.get("model") == t.model_id):
                self.sleeping.pop(t.model_id, None)
                op.version = self.holds.release("sleeping", t.model_id)
        op.version = self.publisher.publish()
        yield from self._acks(op)
        self._finish(op)

    def _update(self, op: _Op, path: str, version: str) -> Steps:
        tier = op.tiers[0]
        failed = yield from self._on_engines(op, "stage_weights", {"path": path, "version": version})
        if failed:
            yield from self._on_engines(op, "discard_weights", {}, record=False)
            busy = all(r.get("busy") for r in op.results.values() if not r["ok"])
            self._finish(op, "busy" if busy else "invalid", f"the new weights were refused by {failed}; every "
                         "engine serves the old weights")
            return
        op.version = self.holds.hold("updating", tier.model_id, version)
        op.pause_started = time.monotonic()
        yield from self._acks(op)
        failed = yield from self._on_engines(op, "commit_weights", {})
        staged = replace(tier.source, path=path, weights="gguf" if path.endswith(".gguf") else "hf")
        if not failed:
            self.weights[tier.model_id] = (staged, version)
        op.version = self.holds.release("updating", tier.model_id)
        op.pause_s = round(time.monotonic() - op.pause_started, 4)
        yield from self._acks(op)
        if failed:
            self._finish(op, "failed", f"the swap failed on {failed}: replace those engines (launch reload)")
        else:
            log.info("model %s serves weights %r from %s (admission held %.0f ms)", tier.model_id, version, path,
                     op.pause_s * 1000)
            self._finish(op)

    def _relabel(self, op: _Op, version: str) -> Steps:
        failed = yield from self._on_engines(op, "set_weight_version", {"version": version})
        if not failed:
            for t in op.tiers:
                source, _ = self.spawn_weights(t)
                self.weights[t.model_id] = (source, version)
            op.version = self.publisher.publish()
            yield from self._acks(op)
        self._finish(op, *(("failed", f"relabelling failed on {failed}") if failed else ()))

    def _on_hosts(self, op: _Op, hosts: list) -> Steps:
        """A gateway host's operation: every engine host serving one of the models carries it out as its own; the
        cluster state here follows what they did."""
        now, asked = time.monotonic(), {}
        for t in op.tiers:
            for host in hosts:
                if t.model_id in host.models(now):
                    self._ids += 1
                    if host.operate(RemoteOperation(self._ids, op.cmd.op, t.model_id, op.cmd.args)):
                        asked[(host, self._ids)] = t.model_id
        deadline = now + REMOTE_TIMEOUT
        yield lambda now: all(i in h.replies for h, i in asked) or now > deadline
        outcomes, messages, done = [], [], {t.model_id: True for t in op.tiers}
        for (host, i), model in asked.items():
            reply = host.replies.pop(i, None)
            if reply is None:
                outcomes.append("failed")
                messages.append(f"engine host {host.url} did not answer in {REMOTE_TIMEOUT:.0f}s")
                done[model] = False
                continue
            for e in reply.engines:
                op.results[len(op.results)] = {**e, "host": host.url}
            op.pause_s = max(op.pause_s or 0.0, reply.pause_s or 0.0) if reply.pause_s is not None else op.pause_s
            outcomes.append(reply.outcome)
            messages.append(f"engine host {host.url}: {reply.message}")
            done[model] = done[model] and reply.outcome == "ok"
        if not asked:
            outcomes, messages = ["failed"], ["no engine host serving the model answers"]
        self._follow_hosts(op, {m for m, ok in done.items() if ok and asked})
        op.version = self.publisher.publish()
        yield from self._acks(op)
        worst = min(outcomes, key=OUTCOME_ORDER.index)
        self._finish(op, worst, "; ".join(messages))

    def _follow_hosts(self, op: _Op, models: set[str]) -> None:
        """What the engine hosts did, in this host's cluster state: the models asleep, the weight versions."""
        args = op.cmd.args or {}
        for model in models:
            engines = [r for r in op.results.values() if r.get("model") == model]
            if op.cmd.op == "sleep":
                self.sleeping[model] = max(int(args.get("level", 1)), self.sleeping.get(model, 0))
            elif op.cmd.op == "wake_up" and not any(r.get("sleeping") for r in engines):
                self.sleeping.pop(model, None)
            elif op.cmd.op in ("update_weights", "update_weight_version"):
                version = next((r["version"] for r in engines if r.get("version")), None)
                tier = next(t for t in op.tiers if t.model_id == model)
                if version is not None:
                    self.weights[model] = (self.spawn_weights(tier)[0], version)

    # -- the building blocks ---------------------------------------------------------------------------------
    def _on_engines(self, op: _Op, name: str, args: dict, record: bool = True) -> Generator[Condition, None, str]:
        """Send ``name`` to every ready engine of the operation's models and wait for all their answers; the
        engines that failed it, named (\"\" when none did)."""
        results: dict[int, dict] = {}
        saved, op.results = op.results, results
        expected: set[int] = set()
        for t in op.tiers:
            for c in self._engines(t):
                self._ids += 1
                if c.send(EngineOp(self._ids, name, args)):
                    self._sent[self._ids] = (op, c.index)
                    expected.add(c.index)
        deadline = time.monotonic() + ENGINE_TIMEOUT
        yield lambda now: expected <= set(results) or now > deadline or not self._alive(expected - set(results))
        for rank in expected - set(results):
            results[rank] = {"engine": rank, "model": self._model_of(rank), "ok": False,
                             "error": f"engine {rank} did not answer {name} in {ENGINE_TIMEOUT:.0f}s or exited"}
        self._sent = {i: s for i, s in self._sent.items() if s[0] is not op}
        if not record:
            op.results = saved
        failed = [r for r in results.values() if not r["ok"]]
        if not expected:
            op.results[-1] = {"engine": None, "ok": False, "error": "no engine of the model is ready"}
            return "every engine (none is ready)"
        return ", ".join(f"engine {r['engine']} ({r['error']})" for r in failed)

    def _acks(self, op: _Op) -> Generator[Condition, None, None]:
        since, version = time.monotonic(), op.version
        yield lambda now: not self.publisher.lagging(version) or now - since > ACK_TIMEOUT
        op.unacked = self.publisher.lagging(version)

    def _finish(self, op: _Op, outcome: str = "ok", message: str | None = None) -> None:
        if op.pause_started is not None and op.pause_s is None and op.cmd.op != "sleep":
            op.pause_s = round(time.monotonic() - op.pause_started, 4)
        if outcome == "ok" and any(not r["ok"] for r in op.results.values()):
            bad = [r for r in op.results.values() if not r["ok"]]
            outcome = "busy" if all(r.get("busy") for r in bad) else "failed"
            message = "; ".join(f"engine {r['engine']}: {r['error']}" for r in bad)
        message = message or f"{op.cmd.op} done on {len(op.results)} engine(s) of {', '.join(op.models)}"
        if outcome != "ok":
            log.warning("%s of %s: %s", op.cmd.op, ", ".join(op.models), message)
        engines = tuple(sorted((r for r in op.results.values()), key=lambda r: (r.get("engine") is None,
                                                                                 r.get("engine") or 0)))
        op.answer.set(OperationReply(outcome, message[:4000], op.cmd.op, op.models, engines,
                                     round(time.monotonic() - op.started, 4), op.pause_s, op.version,
                                     tuple(op.unacked)))
        op.steps = None

    # -- the loop --------------------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        for op in list(self.running):
            self._advance(op, now)
        self._follow(now)

    def _advance(self, op: _Op, now: float) -> None:
        while op.steps is not None and (op.waiting is None or op.waiting(now)):
            try:
                op.waiting = next(op.steps)
            except StopIteration:
                op.steps = None
        if op.steps is None and op in self.running:
            self.running.remove(op)

    def _follow(self, now: float) -> None:
        """An engine that reported after its model went to sleep (a restart, a scale-up) is put to sleep too."""
        busy = {m for o in self.running for m in o.models}
        for t in self.tiers:
            level = self.sleeping.get(t.model_id)
            if level is None or t.model_id in busy:
                continue
            for c in self._engines(t):
                if c.condition is not None and c.condition.sleeping < level and not c.sleep_sent:
                    c.sleep_sent = c.send(EngineOp(0, "sleep", {"level": level}))

    # -- lookups ---------------------------------------------------------------------------------------------
    def _engines(self, tier: ModelTier) -> list[Child]:
        ready = {e.rank for e in self.publisher.state.engines if e.state == EngineState.READY}
        return [c for c in self.processes.live("engine") if tier.owns(c.index) and c.index in ready
                and not c.draining]

    def _alive(self, ranks: set[int]) -> bool:
        live = {c.index for c in self.processes.live("engine") if not c.draining}
        return bool(ranks & live)

    def _model_of(self, rank: int) -> str:
        return next((t.model_id for t in self.tiers if t.owns(rank)), "")

    def _tiers(self, model: str | None, every: bool = False) -> list[ModelTier]:
        """The models ``model`` names (None: every one with engines; ``every``: the engines are on engine hosts)."""
        tiers = [t for t in self.tiers if every or t.desired > 0 or t.spec.engines > 0]
        if model is None:
            if not tiers:
                raise Refused("this server runs no engine (a render server, or engines on other hosts)")
            return tiers
        found = [t for t in tiers if model == t.model_id or model in t.names]
        if not found:
            raise Refused(f"no model {model!r} is served here: one of {', '.join(t.model_id for t in tiers)}",
                          "not_found")
        return found
