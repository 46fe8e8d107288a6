"""LoRA adapters as cluster state: one owner (the supervisor) decides which adapters each model serves, every
engine of the model loads them, every gateway serves their names.

Two sets per model, both here:

- ``desired``: the adapters its engines should have (name → directory). The loop (``tick``) makes each local
  engine match it: an engine that lacks one gets ``LoraCommand("load")`` on its control pipe, one that has an
  adapter no longer desired gets ``LoraCommand("unload")``; each answers ``LoraReport`` with what it serves now,
  which the cluster state carries per engine (``EngineInfo.loras``), so gateways send an adapter's requests only
  to the engines that have it. An engine that starts later is given the desired set (``spawn_set``) and loads it
  before it says ready.
- ``served``: the adapters every gateway serves (``ClusterState.loras``).

A load (``POST /v1/load_lora_adapter`` on any gateway) is checked here first (the name is free, the directory
is a PEFT adapter inside ``--lora-dir``, symlinks resolved), then desired; once every ready engine of the model
reports it loaded it is served, and the reply goes out once every gateway applied that cluster-state version.
An engine that refuses it (a ``LoraError``: a rank above the limit, shapes of another model) rolls the load back:
it leaves the desired set, the engines that loaded it unload it, and the reply is that engine's error (400).
An unload leaves ``served`` first (new requests get 404 on every gateway as soon as they applied it), then
``desired``: engines refuse new requests for it at once and drop it once its running requests end.

A state machine the supervisor's loop turns; it sees the processes and the publisher only through
``launch.interfaces``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from protocol.cluster import EngineState, LoraInfo
from protocol.control import LoraCommand, LoraReply, LoraReport

from ..children import Child
from ..control_server import ACK_TIMEOUT, Later
from ..interfaces import Processes, Publisher
from ..tiers import ModelTier

log = logging.getLogger("zserve.launch")

ENGINE_TIMEOUT = 120.0  # seconds every ready engine of the model has to load an adapter before the load is undone
SHARED_WAIT = 30.0  # seconds a load or unload waits for the other gateway hosts (their engines load it too)
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


class LoraRefused(ValueError):
    """A load or unload that cannot be carried out as asked: ``outcome`` is its LORA_OUTCOMES key."""

    def __init__(self, message: str, outcome: str = "invalid"):
        super().__init__(message)
        self.outcome = outcome


def confined_path(path: str, lora_dirs: tuple[str, ...]) -> str:
    """The real directory of adapter ``path`` (relative: to the first ``--lora-dir`` that has it), refused unless
    it and its PEFT files lie inside one of ``lora_dirs`` once every symlink and ``..`` is resolved."""
    if not lora_dirs:
        raise LoraRefused("loading LoRA adapters at run time is off: start the server with --lora-dir DIR (the "
                          "directories adapters may be loaded from)")
    if not path or "\0" in path:
        raise LoraRefused("lora_path must be a directory")
    roots = [os.path.realpath(d) for d in lora_dirs]
    candidates = [path] if os.path.isabs(path) else [os.path.join(d, path) for d in lora_dirs]
    real = next((os.path.realpath(c) for c in candidates if os.path.exists(c)), None)
    inside = [r for r in roots if real is not None and os.path.commonpath([r, real]) == r]
    if real is None:
        raise LoraRefused(f"LoRA adapter directory {path!r} does not exist"
                          + ("" if os.path.isabs(path) else " in any --lora-dir"))
    if not inside:
        raise LoraRefused(f"LoRA adapter path {path!r} is outside the directories adapters may be loaded from "
                          f"(--lora-dir: {', '.join(lora_dirs)})")
    if not os.path.isdir(real):
        raise LoraRefused(f"LoRA adapter path {path!r} is not a directory (a PEFT adapter is a directory of "
                          f"{' and '.join(PEFT_FILES)})")
    for name in PEFT_FILES:
        file = os.path.realpath(os.path.join(real, name))
        if not os.path.isfile(file):
            raise LoraRefused(f"{path!r} is not a PEFT LoRA adapter: it has no {name}")
        if os.path.commonpath([inside[0], file]) != inside[0]:
            raise LoraRefused(f"{path!r}: {name} links outside --lora-dir")
    return real


@dataclass
class _Change:
    """A load or unload in progress, answered through ``answer`` when it ends."""

    action: str  # load, unload
    name: str
    model: str
    answer: Later
    started: float
    error: str | None = None  # why it is being rolled back (a load an engine refused, or that timed out)
    failure: str = "invalid"  # the outcome of a roll-back: invalid (an engine refused it), failed (none answered)
    outcome: str = ""  # once set, the change waits for every gateway to apply ``version``, then answers
    version: int = 0
    engines: int = 0
    acks_since: float = 0.0
    adopted: bool = False  # another gateway host's, from the shared state (nobody waits for its answer)
    shared_version: int | None = None  # the shared state's version that carries it to the other gateway hosts


class LoraAdapters:
    def __init__(self, processes: Processes, publisher: Publisher, tiers: list[ModelTier],
                 lora_dirs: tuple[str, ...] = (), remote_errors: Callable[[], dict[str, str]] = dict):
        self.processes = processes
        self.publisher = publisher
        self.tiers = tiers
        self.lora_dirs = lora_dirs
        self.remote_errors = remote_errors  # what engine hosts' engines refused (name -> why)
        self.desired: dict[str, dict[str, str]] = {t.model_id: dict(t.loras) for t in tiers}
        self.served: dict[str, LoraInfo] = {n: LoraInfo(n, t.model_id, p) for t in tiers for n, p in t.loras}
        self.changes: list[_Change] = []
        # Gateway hosts sharing a Redis state (``launch.hosts.shared_state``): write the served set there (its
        # version, or None), and name the hosts that have not applied a version yet.
        self.share: Callable[[str, LoraInfo | None], int | None] = lambda name, info: None
        self.shared_behind: Callable[[int], list[str]] = lambda version: []
        self._shared_names: set[str] = set()  # the adapters the shared state last listed

    # -- what the others read ------------------------------------------------------------------------
    def state(self) -> tuple[LoraInfo, ...]:
        """The adapters every gateway serves (``ClusterState.loras``)."""
        return tuple(self.served.values())

    def wanted(self) -> dict[str, dict[str, str]]:
        """What this cluster wants each model's engines to have: what a gateway host asks its engine hosts for."""
        return {model: dict(adapters) for model, adapters in self.desired.items() if adapters}

    def follow(self, wanted: dict[str, dict[str, str]]) -> None:
        """An engine host: its engines have its own start-time adapters and those its gateway hosts want."""
        for t in self.tiers:
            self.desired[t.model_id] = {**dict(t.loras), **wanted.get(t.model_id, {})}

    def errors(self) -> dict[str, str]:
        """The desired adapters a local engine refused (name -> why): an engine host tells its gateway hosts."""
        return {name: f"{c.name} refused it: {why}" for c in self.processes.live("engine")
                for name, why in c.lora_failed.items() if name in self.desired.get(self._model_of(c), {})}

    def adopt(self, shared: tuple[LoraInfo, ...]) -> None:
        """Gateway hosts sharing a Redis state: serve what another host loaded, stop serving what it unloaded."""
        names = {a.name for a in shared}
        for a in shared:
            tier = next((t for t in self.tiers if t.model_id == a.model), None)
            if a.name in self.served or self._change(a.name) is not None or tier is None or (
                    not tier.spec.engine.enable_lora):
                continue
            log.info("LoRA adapter %r of %s: loading it here too (another gateway host loaded it)", a.name, a.model)
            self.desired[a.model][a.name] = a.path
            self.changes.append(_Change("load", a.name, a.model, Later(), time.monotonic(), adopted=True))
        for name in [n for n in self.served if n in self._shared_names and n not in names]:
            if self._change(name) is None:
                log.info("LoRA adapter %r: unloading it here too (another gateway host unloaded it)", name)
                self.unload(name, Later(), adopted=True)
        self._shared_names = names

    def adopting(self) -> bool:
        """Whether a change another gateway host made is still being applied here."""
        return any(c.adopted for c in self.changes)

    def spawn_set(self, model: str) -> tuple[tuple[str, str], ...]:
        """What an engine of ``model`` that starts now loads before it says ready."""
        return tuple(self.desired.get(model, {}).items())

    def on_report(self, child: Child, msg: LoraReport) -> None:
        """An engine said what it serves (before its Ready, and after each command)."""
        child.loras = msg.loaded
        if msg.name is not None:
            child.lora_sent.discard(msg.name)
            if msg.error is not None:
                child.lora_failed[msg.name] = msg.error
                change = self._change(msg.name, "load")
                if change is not None and change.error is None:
                    self._roll_back(change, f"{child.name} refused it: {msg.error}")
                elif msg.name in self.served:
                    log.warning("%s could not load LoRA adapter %r (%s): its requests go to the other engines",
                                child.name, msg.name, msg.error)

    # -- the commands ----------------------------------------------------------------------------------
    def load(self, name: str, path: str, model: str | None, answer: Later) -> Later:
        try:
            tier = self._tier(model)
            taken = {n for t in self.tiers for n in (t.model_id, *t.names)}
            if name in taken:
                raise LoraRefused(f"{name!r} is the name of a model served here; give the adapter another name")
            if name in self.served or any(name in d for d in self.desired.values()):
                raise LoraRefused(f"The lora adapter '{name}' has already been loaded. If you want to load it "
                                  "again, unload it first")
            if self._change(name) is not None:
                raise LoraRefused(f"LoRA adapter {name!r} is being loaded or unloaded already")
            real = confined_path(path, self.lora_dirs)
        except LoraRefused as e:
            answer.set(LoraReply(e.outcome, str(e), name, model))
            return answer
        self.desired[tier.model_id][name] = real
        self.changes.append(_Change("load", name, tier.model_id, answer, time.monotonic()))
        log.info("LoRA adapter %r of %s: loading from %s on every engine", name, tier.model_id, real)
        self.tick(time.monotonic())
        return answer

    def unload(self, name: str, answer: Later, adopted: bool = False) -> Later:
        info = self.served.get(name)
        if info is None or self._change(name) is not None:
            said = "is being loaded or unloaded already" if info is not None else "cannot be found"
            answer.set(LoraReply("not_found" if info is None else "invalid", f"The lora adapter '{name}' {said}",
                                 name))
            return answer
        del self.served[name]
        self.desired[info.model].pop(name, None)
        change = _Change("unload", name, info.model, answer, time.monotonic(), adopted=adopted)
        self.changes.append(change)
        log.info("LoRA adapter %r of %s: unloading (its running requests finish)", name, info.model)
        self._settled(change, "unloaded", f"LoRA adapter {name!r} unloaded", change.started)
        self.tick(time.monotonic())
        return answer

    # -- the loop --------------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Make every local engine match the desired set; move each change on."""
        for c in self.processes.live("engine"):
            if c.loras is None or c.draining:
                continue  # not reported yet (it loads the desired set as it starts), or leaving
            want = self.desired.get(self._model_of(c), {})
            for name, path in want.items():
                if name not in c.loras and name not in c.lora_sent and name not in c.lora_failed:
                    if c.send(LoraCommand("load", name, path)):
                        c.lora_sent.add(name)
            for name in c.loras:
                if name not in want and name not in c.lora_sent and c.send(LoraCommand("unload", name)):
                    c.lora_sent.add(name)
            for name in [n for n in c.lora_failed if n not in want]:
                del c.lora_failed[name]  # (loaded again later, it is tried again)
        for change in list(self.changes):
            self._advance(change, now)

    def _advance(self, ch: _Change, now: float) -> None:
        engines = [e for e in self.publisher.state.engines if e.model == ch.model and e.state == EngineState.READY]
        if not ch.outcome:
            self._engines_done(ch, engines, now)
        if not ch.outcome:
            return
        # Settled: answered once every gateway applied the version that carries it (and, for an unload, once no
        # engine serves it to new requests), on every gateway host sharing the state too.
        if ch.outcome in ("loaded", "unloaded") and not ch.adopted and ch.shared_version is None:
            ch.shared_version = self.share(ch.name, self.served.get(ch.name)) or 0
            if ch.shared_version:  # (what the shared state lists now: an unload through another host drops it)
                (self._shared_names.add if ch.action == "load" else self._shared_names.discard)(ch.name)
        behind = self.publisher.lagging(ch.version)
        if not behind and ch.shared_version:
            behind = self.shared_behind(ch.shared_version)
        if behind and now - ch.acks_since <= (SHARED_WAIT if ch.shared_version else ACK_TIMEOUT):
            return
        if ch.action == "unload" and not behind and now - ch.started < ENGINE_TIMEOUT and any(
                ch.name in (c.loras or ()) for c in self.processes.live("engine") if self._model_of(c) == ch.model):
            return  # a local engine still takes it (an engine host's may keep it for another gateway host)
        self.changes.remove(ch)
        secs = round(max(0.0, now - ch.started), 3)
        log.info("LoRA adapter %r of %s: %s in %.0f ms (%d engine(s))", ch.name, ch.model, ch.outcome, secs * 1000,
                 ch.engines)
        ch.answer.set(LoraReply(ch.outcome, ch.error or f"LoRA adapter {ch.name!r} {ch.outcome}", ch.name, ch.model,
                                ch.version, ch.engines, secs, tuple(behind)))

    def _engines_done(self, ch: _Change, engines: list, now: float) -> None:
        """Settle a load once every ready engine of the model has it, or a roll-back once none has it."""
        if ch.error is not None:  # rolling back
            if not any(ch.name in e.loras for e in engines) or now - ch.started > 2 * ENGINE_TIMEOUT:
                self._settled(ch, ch.failure, ch.error, now)
            return
        refused = self.remote_errors().get(ch.name)
        if refused is not None:
            self._roll_back(ch, refused)
            return
        have = [e for e in engines if ch.name in e.loras]
        if engines and len(have) == len(engines):
            self.served[ch.name] = LoraInfo(ch.name, ch.model, self.desired[ch.model][ch.name])
            ch.engines = len(have)
            self._settled(ch, "loaded", f"LoRA adapter {ch.name!r} loaded", now)
        elif now - ch.started > ENGINE_TIMEOUT:
            missing = ", ".join(f"engine {e.rank}" for e in engines if ch.name not in e.loras) or "no ready engine"
            self._roll_back(ch, f"no engine answered in {ENGINE_TIMEOUT:.0f}s ({missing} did not load it)", "failed")

    def _settled(self, ch: _Change, outcome: str, message: str, now: float) -> None:
        ch.outcome = outcome
        if outcome not in ("loaded", "unloaded"):
            ch.error = message
        elif ch.action == "unload":
            ch.engines = sum(1 for c in self.processes.live("engine") if self._model_of(c) == ch.model)
        ch.version = self.publisher.publish()
        ch.acks_since = now

    def _roll_back(self, ch: _Change, why: str, failure: str = "invalid") -> None:
        log.warning("LoRA adapter %r of %s: load rolled back: %s", ch.name, ch.model, why)
        ch.error, ch.failure = why, failure
        self.desired[ch.model].pop(ch.name, None)

    # -- lookups ---------------------------------------------------------------------------------------
    def _change(self, name: str, action: str | None = None) -> _Change | None:
        return next((c for c in self.changes if c.name == name and action in (None, c.action)), None)

    def _model_of(self, child: Child) -> str:
        return next((t.model_id for t in self.tiers if t.owns(child.index)), "")

    def _tier(self, model: str | None) -> ModelTier:
        lora = [t for t in self.tiers if t.spec.engine.enable_lora]
        if model is not None:
            found = [t for t in self.tiers if model == t.model_id or model in t.names]
            if not found:
                raise LoraRefused(f"no model {model!r} is served here", "not_found")
            if found[0] not in lora:
                raise LoraRefused(f"model {model!r} serves no LoRA adapters: start it with --enable-lora")
            return found[0]
        if len(lora) == 1:
            return lora[0]
        if not lora:
            raise LoraRefused("no model here serves LoRA adapters: start the server with --enable-lora")
        raise LoraRefused(f"several models serve LoRA adapters ({', '.join(t.model_id for t in lora)}): name the "
                          "base model")

