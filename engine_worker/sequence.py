"""One request inside the engine: its tokens, its KV blocks and where it is in its life.

A sequence knows nothing of the transport: which client asked for it is the server's business
(``EngineServer.requests``), so the scheduler and the tests build and move sequences alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto

from protocol import PoolRequest, SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()  # queued, never admitted
    RUNNING = auto()  # holds KV blocks and is scheduled step by step
    PREEMPTED = auto()  # blocks taken back; queued again to recompute prompt + output
    FINISHED = auto()  # stopped, hit a limit, or aborted (``finish_reason`` says which)


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens already in the KV cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full, cached blocks
    prompt_block_hashes: list[int] = field(default_factory=list)
    inflight: set[int] = field(default_factory=set)  # its prompt-block hashes counted in Scheduler._inflight
    announced: list[int] = field(default_factory=list)  # its prompt-block hashes told stored on arrival (BlockManager)
    grammar: object | None = None  # structured output: its ``grammar.GrammarHandle``
    pool: PoolRequest | None = None  # an embedding request: run the prompt, return its last hidden state
    lora: str | None = None  # the LoRA adapter it runs with (``engine_worker.lora``); None: the base model
    tenant: str = ""  # who sent it (``zserve.tenants``); "": no tenants file. ``engine_worker.fairness`` shares by it
    weight: float = 1.0  # its tenant's scheduling weight
    queue_time: float | None = None  # seconds from arrival to its first admission
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_preemptions: int = 0
    # Prompt logprobs gathered chunk by chunk until they go out with the first token.
    prompt_lps: list[float] | None = None
    prompt_top_ids: list[int] | None = None
    prompt_top_lps: list[float] | None = None
    prompt_ranks: list[int] | None = None

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not yet sent (they go out with the first token)."""
        return self.sampling.prompt_logprobs is not None and not self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens ``start..end-1`` of prompt + output."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]
