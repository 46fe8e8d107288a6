"""The admission owner: the one place that decides which models' new requests gateways hold or refuse.

Holds are keyed by (reason, model) (``protocol.holds``): an operator's pause (every model, or one), a resize or a
rolling restart of one model, a model whose engines all crash-loop. Operations ask for a hold and release it;
the owner adds what other hosts say (an engine host's holds of its models, the operators' pauses every gateway
host shares in Redis) and hands the whole set to the cluster publisher, which carries it to every gateway in the
cluster state. ``hold`` and ``release`` return the cluster-state version that carries the change: an operation
waits until every gateway applied it (``Publisher.lagging``) before it goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from protocol.holds import Hold

log = logging.getLogger("zserve.launch")

Key = tuple[str, "str | None"]


class Admission:
    def __init__(self, publish: Callable[[], int], clock: Callable[[], float] = time.time):
        self._publish = publish  # the cluster publisher's: publish the state now, return its version
        self._clock = clock
        self._local: dict[Key, Hold] = {}
        self._remote: tuple[Hold, ...] = ()  # the engine hosts' holds of the models served here

    # -- what operations and operators ask ------------------------------------------------------------------
    def hold(self, reason: str, model: str | None, detail: str = "") -> int:
        """Hold (or refuse, as the reason says) new requests of ``model`` (None: every model); a hold held
        already keeps its age and takes the new ``detail``."""
        old = self._local.get((reason, model))
        if old is None or old.detail != detail:
            self._local[(reason, model)] = Hold(reason, model, old.since if old else self._clock(), detail)
            if old is None:
                log.info("admission: %s held (%s%s)", model or "every model", reason, f": {detail}" if detail else "")
        return self._publish()

    def release(self, reason: str, model: str | None) -> int:
        if self._local.pop((reason, model), None) is not None:
            log.info("admission: %s released (%s)", model or "every model", reason)
        return self._publish()

    def pause(self, model: str | None) -> int:
        """An operator's /pause: of one model, or of every model."""
        return self.hold("paused", model)

    def resume(self, model: str | None) -> int:
        """An operator's /resume: of one model's pause, or (None) of every pause an operator gave."""
        for key in [k for k in self._local if k[0] == "paused" and (model is None or k[1] == model)]:
            del self._local[key]
            log.info("admission: %s resumed", key[1] or "every model")
        return self._publish()

    @property
    def paused(self) -> frozenset[str | None]:
        """The models an operator paused (None: every model)."""
        return frozenset(m for r, m in self._local if r == "paused")

    def set_paused(self, models: Iterable[str | None]) -> int:
        """Take the operators' pauses another host wrote (the shared state): exactly these, no others."""
        models = frozenset(models)
        for model in self.paused - models:
            del self._local[("paused", model)]
        for model in models - self.paused:
            self._local[("paused", model)] = Hold("paused", model, self._clock())
        return self._publish()

    # -- what other hosts say -------------------------------------------------------------------------------
    def follow_remote(self, holds: Iterable[Hold]) -> bool:
        """The holds of the engine hosts (on their models): whether they changed. The publisher calls it while
        it gathers the state, so the new engines and the holds reach gateways in one version."""
        got = tuple(sorted(set(holds), key=lambda h: (h.reason, h.model or "")))
        changed = got != self._remote
        if changed:
            old, new = {h.key for h in self._remote}, {h.key for h in got}
            for reason, model in sorted(new - old, key=str):
                log.info("admission: %s held (%s, on its engine host)", model or "every model", reason)
            for reason, model in sorted(old - new, key=str):
                log.info("admission: %s released (%s, on its engine host)", model or "every model", reason)
        self._remote = got
        return changed

    # -- what the publisher carries -------------------------------------------------------------------------
    def holds(self) -> tuple[Hold, ...]:
        merged = dict(self._local)
        for h in self._remote:
            merged.setdefault(h.key, h)
        return tuple(merged[k] for k in sorted(merged, key=lambda k: (k[0], k[1] or "")))

    def local_holds(self) -> tuple[Hold, ...]:
        """This host's own (an engine host's registry carries these to gateway hosts)."""
        return tuple(self._local[k] for k in sorted(self._local, key=lambda k: (k[0], k[1] or "")))

    def holding(self, reason: str, model: str | None) -> bool:
        return (reason, model) in self._local
