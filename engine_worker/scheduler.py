"""Continuous batching over the paged KV cache: which sequences run in the next forward pass.

Every step, within a token budget (``max_num_batched_tokens``):

1. each running sequence that is decoding feeds its one new token (decodes go first, so a long
   prompt never stalls the streams already flowing);
2. running sequences still in prefill feed their next prompt chunk (chunked prefill);
3. waiting requests are admitted in order of ``priority`` (lower first, default 0), then first
   come, first served, while there is budget, a free sequence slot (``max_num_seqs``) and KV blocks.
   A request whose prompt starts with cached blocks (automatic prefix caching) takes them and
   prefills only the rest.

While requests of several tenants are here (``engine_worker.fairness``), the tenant furthest below its weighted
share of tokens served goes first at 2 and 3: its newcomers are admitted before the others' prompt chunks, a
newcomer of a tenant below another's share takes a sequence slot from that tenant's request still in its prompt
when none is free, and the tenants above the lowest counter have at most ``FAIR_CHUNK`` of the budget for prompts
(none in a step where a prompt of a tenant below them runs), so steps stay short for the light tenant's next arrival.

When a running sequence needs a KV block and none is free, the newest running sequence not yet
scheduled this step (of the lowest priority present) is *preempted*: its blocks are freed and it
goes back to the front of the queue with its generated tokens. When it is admitted again it
recomputes prompt + output (its own blocks are often still in the prefix cache), then continues
exactly where it stopped: the sample at the end of the recompute is the next token (a seeded one
drawn for its position: ``sampler.seeded_uniform``), so preemption changes no output. A migrated
request (``AddRequest.output_token_ids``: it generated tokens on an engine it lost) is queued the
same way: it computes prompt + those tokens, its grammar replays them, and it goes on after them.

A request with structured output waits in the queue (skipped, not blocking the others) until its
grammar has compiled on the compile thread (``grammar.Grammars``); one whose grammar fails ends with
an error output. After every sampled token the scheduler feeds the token to the request's matcher:
a complete grammar ends the request with "stop".

A request for a LoRA adapter (``Sequence.lora``) is admitted only while the running sequences use fewer than
``max_loras`` distinct adapters, or already use its own; otherwise it waits (skipped, not blocking the others), so
no step holds more adapters than the runner has compute slots. Its prefix-cache chain starts at its adapter's
root, so KV computed through one adapter is never reused by another or by the base model.

Requests with the same prompt (``n > 1`` fanned out by the gateway) share the prompt's full
blocks: a request whose next uncached block is being computed by a running request waits one
step until that block is cached, instead of computing it twice.

The scheduler owns the ``BlockManager`` (the runner only sizes the pool) and drives the engine:
``step()`` is schedule → ``runner.execute`` → update, the one loop body of the server, the tests
and the benchmarks. It touches no sockets and no tensors, so it can be tested in-process.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from protocol import PoolOutput, PoolRequest, RequestOutput, SamplingParams, TopLogprobs
from protocol.constants import ERR_STRUCTURED_OUTPUT
from protocol.kv_events import chain_root

from .block_manager import BlockManager, block_hashes
from .expert_parallel import GroupLost
from .fairness import PROMPT_COST, Fairness
from .grammar import Grammars
from .pooling import shape_embedding
from .runner import SampleOut, SeqInput
from .sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from .lora import LoraManager

log = logging.getLogger("zserve.engine")

STATS_WINDOW = 64  # steps averaged for tokens_per_step
FAIR_CHUNK = 0.25  # the share of a step's budget for the prompts of tenants above their share (``_Share``)


class Executor(Protocol):
    """What the scheduler needs of the runner (``ModelRunner`` has these): the KV pool's geometry,
    the limits that end a request, and one forward pass."""

    max_model_len: int
    eos_token_ids: list[int]
    num_blocks: int
    block_size: int

    def execute(self, seqs: list[SeqInput]) -> list[SampleOut | None]: ...


@dataclass
class ScheduledStep:
    seqs: list[Sequence]
    inputs: list[SeqInput]

    @property
    def num_tokens(self) -> int:
        return sum(len(i.new_token_ids) for i in self.inputs)


class Scheduler:
    def __init__(self, runner: Executor, max_num_seqs: int, max_num_batched_tokens: int, *,
                 enable_prefix_caching: bool = True, grammars: Grammars | None = None,
                 loras: LoraManager | None = None, fair: bool = True):
        """``loras``: the runner's adapters (``ModelRunner.loras``); None: requests for adapters are refused.
        ``fair``: requests of several tenants are admitted by weighted fairness (``engine_worker.fairness``); off:
        by priority and arrival only (``--scheduling fifo``)."""
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.runner = runner
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching)
        self.model_id = getattr(runner, "model_id", "")
        self.root = chain_root(self.model_id)  # the base model's prefix chain starts here
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}
        self.grammars = grammars
        self.loras = loras
        self.lora_closing: set[str] = set()  # unloaded while requests still use them: dropped once they end
        self.fairness = Fairness(credit=max_num_batched_tokens * PROMPT_COST) if fair else None
        # An engine operation waits for the started requests (``operations``): those not started stay queued.
        self.hold_new = False
        self._failed: list[Sequence] = []  # ended while waiting (their grammar failed), reported by step()
        # Hashes of full prompt blocks that running sequences are computing right now.
        self._inflight: Counter[int] = Counter()
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.steps = 0
        self.preemptions = 0
        self._recent_tokens: deque[int] = deque(maxlen=STATS_WINDOW)

    # -- admission ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> str | None:
        """Queue a request; return an error message instead when it can never run."""
        if seq.request_id in self.by_id:
            return f"request id {seq.request_id!r} is already running on this engine"
        max_len = self.runner.max_model_len
        if seq.total_len >= max_len:
            resumed = f" and {len(seq.output_ids)} generated" if seq.output_ids else ""
            return f"prompt has {len(seq.prompt_ids)} tokens{resumed}; this engine's context is {max_len}"
        if seq.lora is not None and (missing := self.lora_missing(seq.lora)) is not None:
            return missing
        if seq.sampling.structured is not None and seq.grammar is None:
            if self.grammars is None:
                return "structured output is not available on this engine"
            seq.grammar = self.grammars.start(seq.sampling.structured)
        bm = self.block_manager
        if bm.enable_prefix_caching:
            root = self._root(seq)
            seq.prompt_block_hashes = block_hashes(seq.prompt_ids, bm.block_size, root)
            if not seq.wants_prompt_logprobs:  # (those compute every block)
                seq.announced = bm.announce(seq.prompt_block_hashes, seq.prompt_ids, root, seq.lora)
        self._enqueue(seq, front=False)
        self.by_id[seq.request_id] = seq
        if self.fairness is not None:
            self.fairness.arrived(seq.tenant)
        return None

    def lora_missing(self, name: str) -> str | None:
        """Why a request for LoRA adapter ``name`` cannot run here (None: it can)."""
        if self.loras is None:
            return f"LoRA adapter {name!r} is not loaded: this engine serves no LoRA adapters (--enable-lora)"
        if name in self.lora_closing:
            return f"LoRA adapter {name!r} is being unloaded from this engine"
        return None if name in self.loras else f"LoRA adapter {name!r} is not loaded on this engine"

    # -- LoRA adapters at run time ------------------------------------------------------------
    def loaded_loras(self) -> tuple[str, ...]:
        """The adapters new requests may use (those being unloaded are not)."""
        return () if self.loras is None else tuple(n for n in self.loras.names() if n not in self.lora_closing)

    def load_lora(self, name: str, path: str) -> str | None:
        """Load adapter ``name`` from ``path``; why it was not loaded (nothing changed then), or None."""
        from .lora import LoraError

        if self.loras is None:
            return "this engine serves no LoRA adapters (--enable-lora)"
        if name in self.lora_closing:
            return (f"LoRA adapter {name!r} is still being unloaded ({self._lora_users(name)} request(s) finishing); "
                    "load it again once they end")
        try:
            self.loras.load(name, path)
        except LoraError as e:
            return str(e)
        return None

    def unload_lora(self, name: str) -> None:
        """Refuse new requests for adapter ``name`` from now on; drop it once the requests using it have ended."""
        if self.loras is not None and name in self.loras:
            self.lora_closing.add(name)
            self.drop_closed_loras()

    def drop_closed_loras(self) -> None:
        """Drop the adapters being unloaded that no request uses any more (after each step)."""
        for name in [n for n in self.lora_closing if not self._lora_users(n)]:
            self.lora_closing.discard(name)
            self.loras.unload(name)  # type: ignore[union-attr]
            # Its KV is forgotten: an adapter loaded again under this name (other weights, perhaps) chains from
            # the same root (``chain_root(model, name)``, which gateways compute too) and must find none of it.
            self.block_manager.forget_adapter(name)

    def _lora_users(self, name: str) -> int:
        return sum(s.lora == name for s in self.running) + sum(s.lora == name for s in self.waiting)

    def add_pool(self, req: PoolRequest) -> str | None:
        """An embedding request on a generating model: its prompt runs like any other (chunked, in
        the batch, through the prefix cache) and, instead of a token, its last token's hidden state
        after the final norm comes back (last-token pooling, as decoder embedding models use)."""
        if req.task != "embed":
            return f"this model does not {req.task} (it serves: generate, embed)"
        return self.add(Sequence(req.request_id, list(req.prompt_token_ids),
                                 SamplingParams(max_tokens=1, temperature=0.0), pool=req))

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        """Into the waiting queue, ordered by priority: behind its equals (a new request) or
        before them (a preempted one, which was admitted before them)."""
        pr = seq.sampling.priority
        if not self.waiting or (not front and self.waiting[-1].sampling.priority <= pr):
            self.waiting.append(seq)  # the common case: every priority equal
            return
        for i, w in enumerate(self.waiting):
            if w.sampling.priority > pr or (front and w.sampling.priority == pr):
                self.waiting.insert(i, seq)
                return
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.by_id.pop(request_id, None)
        if seq is None:
            return None
        if self.fairness is not None:
            self.fairness.left(seq.tenant)
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        return seq

    def abort_all(self, reason: str) -> list[Sequence]:
        seqs = list(self.running) + list(self.waiting)
        for s in seqs:
            self.abort(s.request_id)
            s.finish_reason = reason
        return seqs

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_preempted(self) -> int:
        return sum(1 for s in self.waiting if s.status is SequenceStatus.PREEMPTED)

    @property
    def kv_used(self) -> float:
        """Fraction of KV blocks held by requests (for EngineStats)."""
        return self.block_manager.num_used / self.block_manager.num_blocks

    def stats_fields(self) -> dict:
        """The EngineStats fields this engine reports (the server adds rank and timestamp)."""
        bm = self.block_manager
        return {"running": len(self.running), "waiting": len(self.waiting),
                "kv_used": min(1.0, max(0.0, float(self.kv_used))), "generated_tokens": self.generated_tokens,
                "steps": self.steps, "preempted": self.num_preempted, "preemptions": self.preemptions,
                "kv_blocks_used": bm.num_used, "kv_blocks_total": bm.num_blocks, "kv_blocks_cached": bm.num_cached,
                "prefix_cache_hit_rate": min(1.0, max(0.0, bm.hit_rate)), "prefix_cache_hits": bm.hits,
                "prefix_cache_queries": bm.queries, "prompt_tokens": self.prompt_tokens,
                "tokens_per_step": float(self.tokens_per_step),
                **self._lora_stats()}

    def _lora_stats(self) -> dict:
        loras = self.loras
        if loras is None:
            return {}
        return {"max_loras": loras.max_loras, "lora_slot_fills": loras.slot_fills,
                "running_loras": tuple(sorted({s.lora for s in self.running if s.lora is not None})),
                "waiting_loras": tuple(sorted({s.lora for s in self.waiting if s.lora is not None}))}

    @property
    def tokens_per_step(self) -> float:
        return sum(self._recent_tokens) / len(self._recent_tokens) if self._recent_tokens else 0.0

    # -- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the forward pass, apply its samples: the outputs of this step. A failed
        forward pass fails the requests in it (with an ``error`` output each), not the engine."""
        step = self.schedule()
        failed = [RequestOutput(s.request_id, (), "error", error=s.grammar.error[:4000],
                                error_code=ERR_STRUCTURED_OUTPUT) for s in self._failed]
        self._failed.clear()
        if not step.seqs:
            return failed
        try:
            results = self.runner.execute(step.inputs)
        except GroupLost:
            raise  # the expert-parallel group is down: the engine ends every request (ep_server)
        except Exception as e:
            log.exception("forward pass failed; failing the %d requests in it", len(step.seqs))
            return failed + [RequestOutput(s.request_id, (), "error", error=f"engine error: {e}"[:4000])
                             for s in step.seqs if self.abort(s.request_id) is not None]
        return failed + [out for _, out in self.update(step, results)]

    def schedule(self) -> ScheduledStep:
        budget = self.max_num_batched_tokens
        chosen: dict[int, tuple[Sequence, int]] = {}  # id(seq) -> (seq, new tokens), in order
        fair = self._contended()
        share = _Share(self.fairness, fair is not None, budget)

        for seq in list(self.running):  # decodes first: the streams already flowing never stall
            if budget <= 0:
                break
            if seq not in self.running or id(seq) in chosen or seq.total_len - seq.num_computed != 1:
                continue  # preempted in this loop, or already scheduled, or still in its prompt
            if not self._reserve(seq, 1, chosen):
                share.preempted = True
                continue
            chosen[id(seq)] = (seq, 1)
            budget -= 1

        # Prompt chunks: of the running sequences, then of newcomers; while tenants contend, the tenant furthest below
        # its share first (its new requests before the others' chunks), and the others within ``_Share``'s cap.
        prefilling = [s for s in self.running if id(s) not in chosen and s.total_len - s.num_computed > 1]
        if fair is not None:
            prefilling.sort(key=lambda s: fair.rank(s.tenant))
        for seq in prefilling:
            if budget <= 0:
                break
            if fair is not None:  # (without contention newcomers come after every running prompt)
                budget = self._admit_waiting(budget, chosen, share, below=(seq.tenant, fair.counter(seq.tenant)))
            if seq not in self.running or id(seq) in chosen:
                continue  # preempted meanwhile
            n = min(seq.total_len - seq.num_computed, budget, share.allows(seq.tenant))
            if n <= 0:
                continue
            if not self._reserve(seq, n, chosen):
                share.preempted = True
                continue
            chosen[id(seq)] = (seq, n)
            share.used(seq.tenant, n)
            budget -= n
        self._admit_waiting(budget, chosen, share)

        seqs = [s for s, _ in chosen.values()]
        inputs = [self._input(s, n) for s, n in chosen.values()]
        return ScheduledStep(seqs, inputs)

    def _contended(self) -> Fairness | None:
        """The fairness counters while they decide the order (fair scheduling, two tenants or more here)."""
        return self.fairness if self.fairness is not None and self.fairness.contended else None

    def _admit_waiting(self, budget: int, chosen: dict[int, tuple[Sequence, int]], share: _Share,
                       below: tuple[str, float] | None = None) -> int:
        """Admit waiting requests while there is budget, a sequence slot and blocks; the budget left. ``below``:
        (tenant, counter) of a running prompt that goes next (while tenants contend): only newcomers of other tenants
        whose counter is not higher go before it. Newcomers are admitted only when nothing
        had to be preempted for blocks this step: otherwise they would take the blocks the preempted sequence needs
        back."""
        while self.waiting and budget > 0 and not share.preempted:
            seq = self._next_waiting()
            if seq is None or (below is not None and (seq.tenant == below[0] or share.counter(seq.tenant) > below[1])):
                break  # (a tie goes to the newcomer: a tenant lifted on arrival ties the lowest counter)
            if len(self.running) >= self.max_num_seqs:
                # Every slot taken: a tenant below its share takes one from the tenant furthest above it (a sequence
                # not scheduled this step: one still in its prompt), instead of waiting for a flood's request to end.
                victim = self._victim(chosen, above=share.counter(seq.tenant)) if share.fair is not None else None
                if victim is None:
                    break
                self._preempt(victim)
                continue
            allowed = share.allows(seq.tenant)
            if allowed <= 0:
                break
            n = self._admit(seq, min(budget, allowed))
            if n is None:
                break
            self.waiting.remove(seq)
            self.running.append(seq)
            chosen[id(seq)] = (seq, n)
            share.used(seq.tenant, n)
            budget -= n
        return budget

    def _next_waiting(self) -> Sequence | None:
        """The first waiting sequence that can run: not still compiling its grammar, and not needing
        an adapter slot while all are taken. Those whose grammar failed leave the queue here, to be
        reported by ``step``."""
        loras = self.loras
        adapters = {s.lora for s in self.running if s.lora is not None} if loras is not None else set()
        fair = self._contended()
        best: Sequence | None = None
        seen: set[str] = set()  # (fair) tenants whose first runnable request was found
        for seq in list(self.waiting):
            if fair is not None and seq.tenant in seen:
                continue  # (the queue is in priority order: a tenant's first runnable request is its best)
            if self.hold_new and seq.status is not SequenceStatus.PREEMPTED and not seq.output_ids:
                continue
            if (loras is not None and seq.lora is not None and seq.lora not in adapters
                    and len(adapters) >= loras.max_loras):
                continue
            g = seq.grammar
            if g is not None:
                if not g.ready:
                    continue
                if g.error is None and g.accepted < len(seq.output_ids):
                    g.replay(seq.output_ids[g.accepted:])  # a migrated request: the tokens it generated elsewhere
                if g.error is not None:
                    self.abort(seq.request_id)
                    seq.finish_reason = "error"
                    self._failed.append(seq)
                    continue
            if fair is None:
                return seq
            seen.add(seq.tenant)
            if best is None or fair.rank(seq.tenant) < fair.rank(best.tenant):
                best = seq  # the tenant furthest below its share (ties: fewer requests here, then the earlier)
        return best

    def _reserve(self, seq: Sequence, n: int, chosen: dict[int, tuple[Sequence, int]]) -> bool:
        """Give ``seq`` the blocks for ``n`` more tokens, preempting the newest unscheduled
        running sequences while none are free. False when ``seq`` itself was preempted."""
        need = self.block_manager.blocks_needed(seq.num_computed + n) - len(seq.block_table)
        while need > 0 and not self.block_manager.can_allocate(need):
            victim = self._victim(chosen)
            if victim is None:
                return False
            self._preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.block_table.extend(self.block_manager.allocate(need))
        return True

    def _victim(self, chosen: dict[int, tuple[Sequence, int]], above: float | None = None) -> Sequence | None:
        """The running sequence to preempt, of those not scheduled this step: of the tenant furthest above its share
        (while tenants contend; ``above``: only of a tenant whose counter is higher), then of the lowest priority,
        then the newest."""
        fair = self._contended()
        candidates = [(fair.counter(s.tenant) if fair is not None else 0.0, s.sampling.priority, i, s)
                      for i, s in enumerate(self.running) if id(s) not in chosen]
        if above is not None:
            candidates = [c for c in candidates if c[0] > above]
        return max(candidates, key=lambda c: c[:3])[3] if candidates else None

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """Take cached blocks and allocate the first chunk of a waiting sequence; return its
        token count, or None when it must wait (no blocks, or its prefix is being computed)."""
        bm = self.block_manager
        use_cache = bm.enable_prefix_caching and not seq.wants_prompt_logprobs
        all_tokens = seq.tokens(0, seq.total_len)
        root = self._root(seq)
        hit = bm.lookup(all_tokens, seq.total_len - 1, root) if use_cache else []
        hashes = seq.prompt_block_hashes
        if use_cache and len(hit) < len(hashes) and self._inflight[hashes[len(hit)]] > 0:
            return None  # a running request is computing this very block: share it next step
        cached = len(hit) * bm.block_size
        n = min(seq.total_len - cached, budget)
        need = bm.blocks_needed(cached + n) - len(hit)
        if not bm.can_allocate(need, hit):
            return None
        bm.take(hit)
        seq.block_table = hit + bm.allocate(need)
        seq.block_hashes = block_hashes(all_tokens[:cached], bm.block_size, root) if hit else []
        seq.num_computed = cached
        if seq.status is SequenceStatus.WAITING:  # first admission
            seq.num_cached_tokens = cached
            seq.queue_time = time.monotonic() - seq.arrival
            if use_cache:
                bm.record_lookup(len(seq.prompt_ids), min(cached, len(seq.prompt_ids)))
        if seq.wants_prompt_logprobs:
            seq.prompt_lps, seq.prompt_top_ids, seq.prompt_top_lps, seq.prompt_ranks = [], [], [], []
        if use_cache:
            for h in hashes[len(hit):]:
                if h not in seq.inflight:
                    seq.inflight.add(h)
                    self._inflight[h] += 1
        seq.status = SequenceStatus.RUNNING
        return n

    def preempt_all(self) -> None:
        """Send every running request back to the queue (its KV blocks freed: it computes its tokens again)."""
        for seq in list(self.running):
            self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq, ending=False)
        seq.num_computed = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.preemptions += 1
        self._enqueue(seq, front=True)

    def _input(self, seq: Sequence, n: int) -> SeqInput:
        start = seq.num_computed
        end = start + n
        prompt_rows = 0
        if seq.wants_prompt_logprobs:
            prompt_rows = max(0, min(end, len(seq.prompt_ids) - 1) - start)
        return SeqInput(
            block_table=seq.block_table,
            new_token_ids=seq.tokens(start, end),
            start_pos=start,
            sampling=seq.sampling,
            past_output_ids=seq.output_ids,
            prompt_ids=seq.prompt_ids,
            sample=end == seq.total_len,
            grammar=seq.grammar,  # type: ignore[arg-type]
            pool=seq.pool is not None,
            prompt_logprobs_rows=prompt_rows,
            lora=seq.lora,
        )

    def update(self, step: ScheduledStep, results: list[SampleOut | None]) -> list[tuple[Sequence, RequestOutput]]:
        """Apply one step's samples; return the output of every sequence that produced one."""
        self.steps += 1
        self._recent_tokens.append(step.num_tokens)
        outputs: list[tuple[Sequence, RequestOutput]] = []
        for seq, inp, res in zip(step.seqs, step.inputs, results):
            if seq.is_finished:
                continue  # aborted between schedule and update
            n = len(inp.new_token_ids)
            prompt = min(n, len(seq.prompt_ids) - seq.num_computed) if seq.num_computed < len(seq.prompt_ids) else 0
            self.prompt_tokens += prompt
            if self.fairness is not None:
                self.fairness.served(seq.tenant, seq.weight, prompt, 1 if res is not None and res.token_id is not None
                                     else 0)
            seq.num_computed += n
            self._cache_full_blocks(seq)
            if res is not None and res.prompt is not None and seq.prompt_lps is not None:
                seq.prompt_lps.extend(res.prompt.logprobs)
                seq.prompt_ranks.extend(res.prompt.ranks)  # type: ignore[union-attr]
                for ids, lps in zip(res.prompt.top_ids, res.prompt.top_logprobs):
                    seq.prompt_top_ids.extend(ids)  # type: ignore[union-attr]
                    seq.prompt_top_lps.extend(lps)  # type: ignore[union-attr]
            if res is not None and res.pooled is not None and seq.pool is not None:
                outputs.append((seq, self._pooled(seq, res.pooled)))
                continue
            if res is None or res.token_id is None:
                continue
            outputs.append((seq, self._emit(seq, res)))
            if seq.finish_reason is not None:
                seq.status = SequenceStatus.FINISHED
                self.running.remove(seq)
                if self.by_id.pop(seq.request_id, None) is not None and self.fairness is not None:
                    self.fairness.left(seq.tenant)
                self._release(seq)
        return outputs

    def _pooled(self, seq: Sequence, vector) -> PoolOutput:
        """End an embedding request with its vector (normalised unless it asked otherwise)."""
        req = seq.pool
        assert req is not None
        seq.finish_reason = "stop"
        seq.status = SequenceStatus.FINISHED
        self.running.remove(seq)
        self.by_id.pop(seq.request_id, None)
        self._release(seq)
        v = shape_embedding(vector, req.dimensions, True if req.normalize is None else req.normalize)
        return PoolOutput(seq.request_id, tuple(v.tolist()), len(seq.prompt_ids))

    def _emit(self, seq: Sequence, res: SampleOut) -> RequestOutput:
        first = not seq.output_ids
        seq.output_ids.append(res.token_id)  # type: ignore[arg-type]
        self.generated_tokens += 1
        seq.finish_reason = self._finish_reason(seq, res.token_id)  # type: ignore[arg-type]
        sp = seq.sampling
        top = None
        if res.top_ids is not None and sp.logprobs:
            top = TopLogprobs(len(res.top_ids), tuple(res.top_ids), tuple(res.top_logprobs or ()))
        prompt_lp = prompt_top = prompt_ranks = None
        if first and sp.prompt_logprobs is not None and seq.prompt_lps is not None:
            prompt_lp, prompt_ranks = tuple(seq.prompt_lps), tuple(seq.prompt_ranks or ())
            if sp.prompt_logprobs:
                prompt_top = TopLogprobs(sp.prompt_logprobs, tuple(seq.prompt_top_ids or ()),
                                         tuple(seq.prompt_top_lps or ()))
            seq.prompt_lps = seq.prompt_top_ids = seq.prompt_top_lps = seq.prompt_ranks = None
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=(res.token_id,),  # type: ignore[arg-type]
            finish_reason=seq.finish_reason,
            logprobs=(res.logprob,) if sp.logprobs is not None and res.logprob is not None else None,
            top_logprobs=top,
            num_prompt_tokens=len(seq.prompt_ids) if first else 0,
            prompt_logprobs=prompt_lp,
            prompt_top_logprobs=prompt_top,
            prompt_ranks=prompt_ranks,
            num_cached_tokens=seq.num_cached_tokens if first else 0,
            error=seq.grammar.error if seq.finish_reason == "error" else None,  # type: ignore[union-attr]
            error_code=ERR_STRUCTURED_OUTPUT if seq.finish_reason == "error" else None,  # only a grammar errs here
            queue_time=seq.queue_time if first and seq.tenant else None,  # per-tenant queue time (with tenants only)
        )

    def _cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks this step filled, so later requests can reuse them."""
        bm = self.block_manager
        if not bm.enable_prefix_caching:
            return
        bs = bm.block_size
        known = seq.prompt_block_hashes  # the prompt's, hashed at admission from the same root
        while len(seq.block_hashes) < seq.num_computed // bs:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else self._root(seq)
            h = bm.register(seq.block_table[i], parent, tuple(seq.tokens(i * bs, (i + 1) * bs)), seq.lora,
                            known[i] if i < len(known) else None)
            seq.block_hashes.append(h)
            if h in seq.inflight:
                self._drop_inflight(seq, h)

    def _root(self, seq: Sequence) -> int | None:
        """Where ``seq``'s prefix-cache chain starts: the model's root, or its adapter's own."""
        if seq.lora is None or self.loras is None:
            return self.root
        return chain_root(self.model_id, seq.lora)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        sp = seq.sampling
        n = len(seq.output_ids)
        if seq.grammar is not None:
            done = seq.grammar.accept(token)  # type: ignore[union-attr]
            if done is not None:
                return done
        if n >= sp.min_tokens:
            if not sp.ignore_eos and token in self.runner.eos_token_ids:
                return "stop"
            if token in sp.stop_token_ids:
                return "stop"
        if n >= sp.max_tokens or seq.total_len >= self.runner.max_model_len:
            return "length"
        return None

    def _release(self, seq: Sequence, ending: bool = True) -> None:
        """Free a sequence's blocks (cached ones stay findable) and forget its in-flight hashes (and, when it ends
        rather than waits again, the prompt blocks it told stored on arrival)."""
        if ending and seq.announced:
            self.block_manager.retract(seq.announced)
            seq.announced = []
        if seq.block_table:
            self.block_manager.free(seq.block_table)
        for h in list(seq.inflight):
            self._drop_inflight(seq, h)
        seq.block_table = []
        seq.block_hashes = []

    def _drop_inflight(self, seq: Sequence, h: int) -> None:
        seq.inflight.discard(h)
        self._inflight[h] -= 1
        if self._inflight[h] <= 0:
            del self._inflight[h]


def run_until_done(scheduler: Scheduler, on_step=None) -> dict[str, list[RequestOutput]]:
    """``scheduler.step()`` until every request has finished; the outputs per request id. For
    offline use (tests, benchmarks). ``on_step(scheduler)`` is called before each step (e.g. to
    add requests mid-flight)."""
    outs: dict[str, list[RequestOutput]] = {}
    while True:
        if on_step is not None:
            on_step(scheduler)
        if not scheduler.has_work:
            return outs
        steps = scheduler.steps
        for out in scheduler.step():
            if getattr(out, "finish_reason", None) == "error" or (isinstance(out, PoolOutput) and out.error):
                raise RuntimeError(f"request {out.request_id}: {out.error}")
            outs.setdefault(out.request_id, []).append(out)
        if scheduler.steps == steps:
            compiling = [s.grammar for s in scheduler.waiting if s.grammar is not None and not s.grammar.ready]
            if not compiling:
                raise RuntimeError("the scheduler has work but scheduled nothing (not enough KV blocks?)")
            compiling[0].wait(60.0)


class _Share:
    """One step's prompt tokens by tenant: the tenants above their share (``Fairness.over_share``) have at most
    ``FAIR_CHUNK`` of the step's budget for prompt chunks between them, so steps stay short and a request of a tenant
    below its share, arriving during one, starts its prompt within a short step rather than after a full budget of
    another tenant's prompts (a step's time grows with its tokens on a compute-bound device). With one tenant (or
    fifo scheduling) it allows everything."""

    def __init__(self, fairness: Fairness | None, contended: bool, budget: int):
        self.fair = fairness if contended else None  # the counters, while they decide the order
        self.preempted = False  # a sequence was preempted for blocks this step: no newcomers
        self.left = max(1, int(budget * FAIR_CHUNK))
        self.capped = fairness.over_share(time.monotonic()) if fairness is not None else set()

    def counter(self, tenant: str) -> float:
        return self.fair.counter(tenant) if self.fair is not None else 0.0

    def allows(self, tenant: str) -> int:
        return self.left if tenant in self.capped else 1 << 30

    def used(self, tenant: str, n: int) -> None:
        if tenant in self.capped:
            self.left -= n
        elif self.capped:
            self.left = 0  # a prompt of a tenant below its share runs in this step: the others' wait for the next
