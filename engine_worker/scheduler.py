"""Continuous batching: which sequences run in the next forward pass, and what their results mean.

Every step the scheduler takes one decode token from each running sequence, then fills the rest
of the per-step token budget with prompt chunks (chunked prefill), so a long prompt never stalls
the streams that are already decoding. Requests join when a KV slot frees up and leave the moment
they finish; the runner never sees a request twice in one step.

The scheduler is pure bookkeeping — no sockets, no tensors — so it can be tested in-process.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from protocol import RequestOutput, SamplingParams, TopLogprobs

from .runner import SampleOut, SeqInput


class SlotAllocator(Protocol):
    max_model_len: int
    eos_token_ids: list[int]

    def allocate_slot(self) -> int | None: ...
    def free_slot(self, slot: int) -> None: ...
    def make_generator(self, seed: int): ...


@dataclass
class Sequence:
    """One request inside the engine."""

    request_id: str
    client: bytes  # ZeroMQ identity of the gateway that owns the request
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens already in the KV cache
    slot: int | None = None
    generator: object | None = None
    finish_reason: str | None = None

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_ids)


@dataclass
class ScheduledStep:
    seqs: list[Sequence]
    inputs: list[SeqInput]

    @property
    def num_tokens(self) -> int:
        return sum(len(i.new_token_ids) for i in self.inputs)


class Scheduler:
    def __init__(self, runner: SlotAllocator, max_num_seqs: int, max_num_batched_tokens: int):
        self.runner = runner
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}
        self.generated_tokens = 0
        self.steps = 0

    # -- admission ---------------------------------------------------------------------------
    def add(self, seq: Sequence) -> str | None:
        """Queue a request; return an error message instead when it can never run."""
        if seq.request_id in self.by_id:
            return f"request id {seq.request_id!r} is already running on this engine"
        max_len = self.runner.max_model_len
        if len(seq.prompt_ids) >= max_len:
            return f"prompt has {len(seq.prompt_ids)} tokens; this engine's context is {max_len}"
        self.waiting.append(seq)
        self.by_id[seq.request_id] = seq
        return None

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.by_id.pop(request_id, None)
        if seq is None:
            return None
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)
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

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        inputs: list[SeqInput] = []
        # Decodes first: one token each, so streams keep flowing whatever arrives.
        for seq in self.running:
            if not seq.in_prefill and budget > 0:
                seqs.append(seq)
                inputs.append(self._input(seq, [seq.output_ids[-1]], sample=True))
                budget -= 1
        # Admit waiting requests into free slots (FCFS).
        while self.waiting and len(self.running) < self.max_num_seqs:
            slot = self.runner.allocate_slot()
            if slot is None:
                break
            seq = self.waiting.popleft()
            seq.slot = slot
            if seq.sampling.seed is not None:
                seq.generator = self.runner.make_generator(seq.sampling.seed)
            self.running.append(seq)
        # Then prompt chunks, oldest first, within what is left of the budget.
        for seq in self.running:
            if seq.in_prefill and budget > 0:
                chunk = seq.prompt_ids[seq.num_computed : seq.num_computed + budget]
                last = seq.num_computed + len(chunk) == len(seq.prompt_ids)
                seqs.append(seq)
                inputs.append(self._input(seq, chunk, sample=last))
                budget -= len(chunk)
        return ScheduledStep(seqs, inputs)

    def _input(self, seq: Sequence, tokens: list[int], sample: bool) -> SeqInput:
        return SeqInput(
            slot=seq.slot,  # type: ignore[arg-type]
            new_token_ids=tokens,
            start_pos=seq.num_computed,
            sampling=seq.sampling,
            past_output_ids=seq.output_ids,
            prompt_ids=seq.prompt_ids,
            sample=sample,
            generator=seq.generator,  # type: ignore[arg-type]
        )

    def update(self, step: ScheduledStep, results: list[SampleOut | None]) -> list[tuple[Sequence, RequestOutput]]:
        """Apply one step's samples; return the output of every sequence that produced one."""
        self.steps += 1
        outputs: list[tuple[Sequence, RequestOutput]] = []
        for seq, inp, res in zip(step.seqs, step.inputs, results):
            seq.num_computed += len(inp.new_token_ids)
            if res is None:
                continue
            seq.output_ids.append(res.token_id)
            self.generated_tokens += 1
            seq.finish_reason = self._finish_reason(seq, res.token_id)
            top = None
            if res.top_ids is not None and seq.sampling.logprobs:
                top = TopLogprobs(len(res.top_ids), tuple(res.top_ids), tuple(res.top_logprobs or ()))
            out = RequestOutput(
                request_id=seq.request_id,
                new_token_ids=(res.token_id,),
                finish_reason=seq.finish_reason,
                logprobs=(res.logprob,) if seq.sampling.logprobs is not None and res.logprob is not None else None,
                top_logprobs=top,
                num_prompt_tokens=len(seq.prompt_ids) if len(seq.output_ids) == 1 else 0,
            )
            outputs.append((seq, out))
            if seq.finish_reason is not None:
                self.running.remove(seq)
                self.by_id.pop(seq.request_id, None)
                self._release(seq)
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        sp = seq.sampling
        n = len(seq.output_ids)
        if n >= sp.min_tokens:
            if not sp.ignore_eos and token in self.runner.eos_token_ids:
                return "stop"
            if token in sp.stop_token_ids:
                return "stop"
        if n >= sp.max_tokens or seq.total_len >= self.runner.max_model_len:
            return "length"
        return None

    def _release(self, seq: Sequence) -> None:
        if seq.slot is not None:
            self.runner.free_slot(seq.slot)
            seq.slot = None
