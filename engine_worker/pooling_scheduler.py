"""Batching for pooling models (embed, classify): every step runs the oldest waiting inputs that fit a
token budget through the encoder in one go, and each input gets its vector back.

A pooling request is one forward pass over its tokens and nothing after, so there is no KV cache,
no decode phase and no preemption: the queue is first come, first served, and a step takes inputs
while their tokens fit ``max_num_batched_tokens`` (at least one input a step, however long, as long
as it fits the model's context). The runner (``pooling.PoolingRunner``) packs the batch itself.

It offers the engine server what ``scheduler.Scheduler`` does (``add_pool``, ``abort``, ``step``,
``has_work``, ``stats_fields``), so one server loop drives either kind of engine.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from protocol import PoolOutput, PoolRequest

from .pooling import shape_embedding

log = logging.getLogger("zserve.engine")


@dataclass
class _Pending:
    req: PoolRequest
    arrival: float = field(default_factory=time.monotonic)


class PoolingScheduler:
    def __init__(self, runner, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.runner = runner
        pooling = getattr(runner, "pooling", None)
        self.default_normalize = bool(pooling.normalize) if pooling is not None else False
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[_Pending] = deque()
        self.running: list = []  # nothing runs between steps: a batch starts and ends in one
        self.steps = 0
        self.prompt_tokens = 0
        self.pooled = 0

    # -- admission ------------------------------------------------------------------------------
    def add_pool(self, req: PoolRequest) -> str | None:
        """Queue a request; return an error message instead when it can never run."""
        if req.task not in self.runner.tasks:  # (a runner may list more, e.g. "score"; the wire asks these)
            return f"this model does not {req.task} (it serves: {', '.join(self.runner.tasks)})"
        limit = self.runner.max_model_len
        if len(req.prompt_token_ids) > limit:
            return f"input has {len(req.prompt_token_ids)} tokens; this model takes at most {limit}"
        if any(r.req.request_id == req.request_id for r in self.waiting):
            return f"request id {req.request_id!r} is already queued on this engine"
        self.waiting.append(_Pending(req))
        return None

    def abort(self, request_id: str) -> _Pending | None:
        for p in self.waiting:
            if p.req.request_id == request_id:
                self.waiting.remove(p)
                return p
        return None

    def abort_all(self, reason: str) -> list[_Pending]:
        gone = list(self.waiting)
        self.waiting.clear()
        return gone

    @property
    def has_work(self) -> bool:
        return bool(self.waiting)

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[PoolOutput]:
        batch: list[_Pending] = []
        tokens = 0
        while self.waiting and len(batch) < self.max_num_seqs:
            n = len(self.waiting[0].req.prompt_token_ids)
            if batch and tokens + n > self.max_num_batched_tokens:
                break
            batch.append(self.waiting.popleft())
            tokens += n
        if not batch:
            return []
        self.steps += 1
        self.prompt_tokens += tokens
        outs: list[PoolOutput] = []
        for task in ("embed", "classify"):
            group = [p.req for p in batch if p.req.task == task]
            if group:
                outs.extend(self._run(task, group))
        return outs

    def _run(self, task: str, group: list[PoolRequest]) -> list[PoolOutput]:
        ids = [list(r.prompt_token_ids) for r in group]
        types = None
        if any(r.pair_start for r in group):  # segment ids: 0 for the first text, 1 from pair_start on
            types = [[0] * (r.pair_start or len(i)) + [1] * (len(i) - (r.pair_start or len(i)))
                     for r, i in zip(group, ids)]
        try:
            if task == "classify":
                vectors = self.runner.classify(ids, token_type_ids=types)
            else:
                vectors = self.runner.embed(ids, normalize=False, token_type_ids=types)
        except Exception as e:  # noqa: BLE001 - a failed batch fails its requests, not the engine
            log.exception("pooling forward pass failed; failing the %d requests in it", len(group))
            return [PoolOutput(r.request_id, (), len(r.prompt_token_ids), f"engine error: {e}"[:4000]) for r in group]
        outs = []
        for r, v in zip(group, vectors):
            if task == "embed":
                v = shape_embedding(v, r.dimensions, self.default_normalize if r.normalize is None else r.normalize)
            self.pooled += 1
            outs.append(PoolOutput(r.request_id, tuple(v.tolist()), len(r.prompt_token_ids)))
        return outs

    def stats_fields(self) -> dict:
        """The EngineStats fields this engine reports (no KV cache, nothing generated)."""
        return {"running": 0, "waiting": len(self.waiting), "kv_used": 0.0, "generated_tokens": 0,
                "steps": self.steps, "prompt_tokens": self.prompt_tokens}
