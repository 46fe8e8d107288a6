"""The operations the supervisor asks of an engine (``protocol.control.EngineOp``), carried out between two steps.

Most are done at once: a cache reset, the profiler, a version label, reading (staging) a new checkpoint beside the
served weights. Two wait until no request that has started runs any more — ``sleep`` and ``commit_weights`` — so no
response is computed partly before and partly after them: from the moment one is pending the scheduler admits no
request that has not started (they wait in the queue, and run once the engine is awake or on the new weights);
the running ones finish first. While asleep the engine takes requests but steps none.

Each answer is an ``EngineOpReport``; a change of what the engine is (asleep, weight version) is also an
``EngineCondition``, which the cluster state carries per engine.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Protocol

import torch

from protocol.control import WAKE_TAGS, EngineCondition, EngineOp, EngineOpReport
from zserve.catalog import ModelSource

from .host_memory import resident_bytes
from .residency import Residency, WeightsRefused, device_bytes


class Host(Protocol):
    """What an operation sees of its engine's server (``server.EngineServer``)."""

    rank: int
    runner: Any
    scheduler: Any
    status: Any

    def quiet(self) -> bool:
        """Whether the engine steps no batch now (an expert-parallel member: its whole group is idle)."""
        ...

    def expert_share(self) -> tuple[int, int] | None:
        """An expert-parallel member's (member, size); None for any other engine."""
        ...

    def use_source(self, source: ModelSource) -> None:
        """The weights come from ``source`` from now on (a member reads new experts there on a resize)."""
        ...

    def publish_kv(self) -> None:
        """Send the KV events the operation caused (a cache forgotten)."""
        ...

log = logging.getLogger("zserve.engine")

DEFAULT_VERSION = "default"  # the weight version of the weights an engine started with (SGLang's word)
WAITING_OPS = ("sleep", "commit_weights")  # carried out once no started request runs


class EngineOps:
    def __init__(self, server: Host, source: ModelSource | None = None, version: str = DEFAULT_VERSION):
        self.server = server
        runner = server.runner
        generating = hasattr(runner, "kv")
        self.residency = Residency(runner, source, server.expert_share) if generating else None
        self.version = version
        self.pending: list[EngineOp] = []
        self.pool_asleep = 0  # a pooling engine's sleep level (it frees nothing: no KV cache; weights kept)
        self.profiler: torch.profiler.profile | None = None
        self.profile_started = 0.0

    # -- what the server asks --------------------------------------------------------------------------
    @property
    def asleep(self) -> bool:
        return bool(self.residency.level if self.residency is not None else self.pool_asleep)

    @property
    def holding(self) -> bool:
        """Whether requests that have not started must wait (an operation waits for the running ones)."""
        return bool(self.pending) or self.asleep

    def condition(self) -> EngineCondition:
        r = self.residency
        level = r.level if r is not None else self.pool_asleep
        return EngineCondition(level, self.version, tuple(t for t in WAKE_TAGS if r is not None and t in r.asleep))

    def handle(self, msg: EngineOp) -> None:
        if msg.op in WAITING_OPS and not (msg.op == "sleep" and self.asleep and self._level(msg) <= self._slept()):
            self.pending.append(msg)
            self.poll()
            return
        self._run(msg)

    def poll(self) -> None:
        """Carry out the waiting operations once no request that has started runs."""
        if not self.pending:
            return  # (the step loop's usual case: nothing to look at)
        sched = self.server.scheduler
        started = getattr(sched, "running", None) or any(getattr(s, "output_ids", None) for s in sched.waiting)
        if started or not self.server.quiet():
            return
        ops, self.pending = self.pending, []
        for msg in ops:
            self._run(msg)
        self.server.publish_kv()

    # -- carrying one out --------------------------------------------------------------------------------
    def _run(self, msg: EngineOp) -> None:
        t0 = time.monotonic()
        try:
            result = getattr(self, "_" + msg.op)(msg.args or {})
        except Busy as e:
            self._report(msg, False, error=str(e), busy=True)
            return
        except WeightsRefused as e:
            self._report(msg, False, error=str(e))
            return
        except Exception as e:  # an operation's failure is reported, never the engine's end
            log.exception("engine %d: %s failed", self.server.rank, msg.op)
            self._report(msg, False, error=f"{type(e).__name__}: {e}")
            return
        result = {**(result or {}), "seconds": round(time.monotonic() - t0, 4)}
        self._report(msg, True, result)

    def _report(self, msg: EngineOp, ok: bool, result: dict | None = None, error: str | None = None,
                busy: bool = False) -> None:
        status = self.server.status
        # What the engine is now goes first: the report may complete the operation, whose reply then says what every
        # engine is (a condition read after the last report missed the cluster state the reply waited for).
        status.send(self.condition())
        if msg.id:
            status.send(EngineOpReport(msg.id, msg.op, ok, result, error[:4000] if error else None, busy))

    def _level(self, msg: EngineOp) -> int:
        return int((msg.args or {}).get("level", 1))

    def _slept(self) -> int:
        return self.residency.level if self.residency is not None else self.pool_asleep

    def _memory(self) -> dict:
        r = self.residency
        device = r.runner.device if r is not None else torch.device("cpu")
        out = {"rss_bytes": resident_bytes()}
        dev = device_bytes(device)
        if dev is not None:
            out["device_bytes"] = dev
        return out

    # -- the operations ----------------------------------------------------------------------------------
    def _sleep(self, args: dict) -> dict:
        level = int(args.get("level", 1))
        before = self._memory()
        if self.residency is None:
            self.pool_asleep = max(self.pool_asleep, level)
        else:
            self.server.scheduler.block_manager.reset()  # the pool's contents go: nothing may be found there
            self.residency.sleep(level)
        log.info("engine %d asleep (level %d): resident memory %.0f -> %.0f MiB", self.server.rank, level,
                 before["rss_bytes"] / 2**20, resident_bytes() / 2**20)
        return {"level": level, "before": before, "after": self._memory()}

    def _wake_up(self, args: dict) -> dict:
        tags = tuple(args.get("tags") or WAKE_TAGS)
        before = self._memory()
        if self.residency is None:
            self.pool_asleep = 0
        else:
            self.residency.wake(tags)
        log.info("engine %d woke %s: resident memory %.0f -> %.0f MiB", self.server.rank, " and ".join(tags),
                 before["rss_bytes"] / 2**20, resident_bytes() / 2**20)
        return {"tags": list(tags), "before": before, "after": self._memory(), "sleeping": self.asleep}

    def _stage_weights(self, args: dict) -> dict:
        if self.residency is None:
            raise WeightsRefused("this engine's model does not generate: its weights are not updated")
        staged = self.residency.stage(str(args["path"]), str(args.get("version", "")))
        return {"path": staged.source.path}

    def _commit_weights(self, args: dict) -> dict:
        if self.residency is None or self.residency.staged is None:
            raise RuntimeError("no weights are staged on this engine")
        staged = self.residency.commit()
        self.server.use_source(staged.source)
        self.server.scheduler.block_manager.reset()  # keys and values of the old weights are no one's prefix
        self.version = staged.version or self.version
        log.info("engine %d serves weights %r from %s", self.server.rank, self.version, staged.source.path)
        return {"version": self.version, "path": staged.source.path}

    def _discard_weights(self, args: dict) -> dict:
        if self.residency is not None:
            self.residency.discard()
        return {}

    def _set_weight_version(self, args: dict) -> dict:
        self.version = str(args["version"])
        return {"version": self.version}

    def _reset_prefix_cache(self, args: dict) -> dict:
        sched = self.server.scheduler
        bm = getattr(sched, "block_manager", None)
        if bm is None:
            return {"reset": False, "cached_blocks": 0}
        if sched.running or sched.waiting:
            if not args.get("reset_running"):
                raise Busy(f"{len(sched.running)} request(s) run and {len(sched.waiting)} wait on engine "
                           f"{self.server.rank}; give reset_running to reset anyway (running requests compute "
                           "their prompts again)")
            sched.preempt_all()
        cached = bm.num_cached
        bm.reset()
        return {"reset": True, "cached_blocks": cached}

    def _reset_mm_cache(self, args: dict) -> dict:
        return {"reset": False, "reason": "this engine has no multimodal cache"}

    def _reset_encoder_cache(self, args: dict) -> dict:
        return {"reset": False, "reason": "this engine has no encoder cache"}

    def _start_profile(self, args: dict) -> dict:
        if self.profiler is not None:
            raise Busy(f"engine {self.server.rank} is profiling already")
        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=acts, record_shapes=bool(args.get("record_shapes")))
        self.profiler.start()
        self.profile_started = time.time()
        return {"started": True}

    def _stop_profile(self, args: dict) -> dict:
        prof = self.profiler
        if prof is None:
            raise Busy(f"engine {self.server.rank} is not profiling")
        self.profiler = None
        prof.stop()
        directory = str(args["dir"])
        os.makedirs(directory, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(self.profile_started))
        path = os.path.join(directory, f"engine-{self.server.rank}-{stamp}-{os.getpid()}.trace.json")
        prof.export_chrome_trace(path)
        return {"trace": path, "bytes": os.path.getsize(path)}


class Busy(RuntimeError):
    """Refused for the engine's state (requests run, the profiler runs or does not): nothing changed."""
