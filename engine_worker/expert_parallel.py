"""Expert parallelism: the experts of a mixture-of-experts model split across the engines of a group.

Attention stays data parallel: every member holds the whole model except the experts, schedules its own
requests and keeps its own KV cache. Only the MoE layers are shared. Member ``r`` of ``size`` holds the
contiguous block ``expert_shard(E, size, r)`` of every layer's experts, and each MoE layer of a step runs as:

1. ``dispatch``: every member's tokens are gathered on every member (one ``all_gather``, padded to the
   largest member's count). The router is replicated, so each member routes all tokens identically.
2. Each member runs its own experts on the tokens routed to them: a partial sum per token.
3. ``combine``: the partial sums are added up and each member gets back the rows of its own tokens (one
   ``reduce_scatter``).

That is the all-gather / reduce-scatter form of expert-parallel dispatch (vLLM's "naive" all2all backend):
two collectives per layer whatever the routing, with no per-layer exchange of split sizes, which on a CPU's
gloo and on small batches costs less than the three of a token-exact ``all_to_all``.

Collectives line up only if every member runs them, so a step is a *group step*: ``begin_step`` gathers each
member's token count first; a member with no work calls ``idle_step``, which runs the MoE collectives on no
tokens of its own while any member has tokens, and returns 0 when the whole group is idle (then everyone stops
stepping and sleeps; ``ep_server`` wakes the group when work arrives). A collective that fails — a member
died — raises ``GroupLost``; the group is then unusable and must be formed again (``ExpertGroup.form``).
torch.distributed uses gloo on CPUs and NCCL on CUDA; the rendezvous is a ``FileStore`` in the supervisor's
private run directory, and gloo's own sockets are kept on the loopback interface.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 120.0
"""How long a collective waits for a member that is alive but slow (a long prefill on a big model); a member
that dies is noticed at once (its sockets close)."""


class GroupLost(RuntimeError):
    """A collective of the expert-parallel group failed: a member died, or the group was torn down."""


def expert_shard(num_experts: int, size: int, rank: int) -> range:
    """The experts member ``rank`` of ``size`` holds: a contiguous block, the first ``E % size`` one larger."""
    if not 0 <= rank < size <= num_experts:
        raise ValueError(f"an expert-parallel group of {size} cannot split {num_experts} experts "
                         f"(member {rank}): each member needs at least one expert")
    base, extra = divmod(num_experts, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


class ExpertGroup:
    """One member's view of a formed group: its rank, the size, and the collectives of a group step."""

    def __init__(self, rank: int, size: int, generation: int, device: torch.device, backend: str = "gloo"):
        self.rank = rank
        self.backend = backend
        # gloo with CUDA tensors (members sharing a GPU, which NCCL refuses): collectives go through host memory
        self.staged = backend == "gloo" and device.type == "cuda"
        self.size = size
        self.generation = generation
        self.device = device
        self.counts: list[int] = [0] * size  # every member's tokens in the current step
        self.steps = 0  # group steps taken (the engine loop checks that each turn took exactly one)
        self.closed = False

    @classmethod
    def form(cls, store_path: str, rank: int, size: int, generation: int, device: torch.device,
             join_timeout: float = 60.0, abandon: Callable[[], bool] | None = None,
             backend: str | None = None) -> ExpertGroup:
        """Join the group whose rendezvous file is ``store_path``; every member must call this. One process
        belongs to one group at a time: ``close`` the old one first.

        The members first count themselves in at the store, calling ``abandon`` between looks (the engine
        reads its sockets there, and gives up when the supervisor has sent a newer command); only when all
        are there does torch.distributed start, so a member that never comes costs no collective timeout."""
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        group = cls(rank, size, generation, device, backend)
        if size == 1:
            return group  # nothing to exchange: no process group at all
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # members are on this host: loopback only
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        deadline = time.monotonic() + join_timeout
        try:
            store = dist.FileStore(store_path, size)
            store.add("joined", 1)
            while (came := store.add("joined", 0)) < size:
                if abandon is None:
                    time.sleep(0.02)  # the interval between looks at the counter
                elif abandon():
                    raise GroupLost("abandoned for a newer group")
                if time.monotonic() > deadline:
                    raise GroupLost(f"{came} of {size} members came within {join_timeout:.0f}s")
            dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=size,
                                    timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
                                    device_id=device if backend == "nccl" else None)
            group.begin_step(0)  # a first collective: every member is really there
        except Exception as e:
            group.close()
            raise GroupLost(f"could not form expert-parallel group {generation} of {size}: {e}") from e
        return group

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.size > 1 and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # a broken group may fail to tear down cleanly; it is gone either way
                log.debug("destroying expert-parallel group %d: %s", self.generation, e)

    # -- a group step ------------------------------------------------------------------------------------
    def begin_step(self, num_tokens: int) -> int:
        """Every member's token count for this step; the group's total (0: the whole group is idle)."""
        self.steps += 1
        if self.size == 1:
            self.counts = [num_tokens]
            return num_tokens
        mine = torch.tensor([num_tokens], dtype=torch.long, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        self._run(dist.all_gather, out, mine)
        self.counts = torch.cat(out).tolist()
        return sum(self.counts)

    def dispatch(self, x: torch.Tensor) -> torch.Tensor:
        """``[my tokens, H]`` → ``[every member's tokens, H]``, in member order."""
        if self.size == 1:
            return x
        pad = max(self.counts)
        send = x if x.shape[0] == pad else torch.cat([x, x.new_zeros(pad - x.shape[0], x.shape[1])])
        out = [torch.empty_like(send) for _ in range(self.size)]
        self._run(dist.all_gather, out, send.contiguous())
        return torch.cat([o[:n] for o, n in zip(out, self.counts)])

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """``[every member's tokens, H]`` partial sums → the summed rows of this member's tokens."""
        if self.size == 1:
            return partial
        pad = max(self.counts)
        parts, at = [], 0
        for n in self.counts:
            part = partial[at : at + n]
            at += n
            parts.append(part if n == pad else torch.cat([part, part.new_zeros(pad - n, part.shape[1])]))
        out = partial.new_empty(pad, partial.shape[1])
        self._run(dist.reduce_scatter, out, [p.contiguous() for p in parts])
        return out[: self.counts[self.rank]]

    def idle_step(self, model) -> int:
        """A step with no tokens of this member's own: take part in every MoE layer's collectives while any
        member has tokens. The group's total tokens (0: everyone is idle)."""
        total = self.begin_step(0)
        if total:
            hidden = model.config.hidden_size
            empty = torch.empty(0, hidden, dtype=model.dtype, device=self.device)
            with torch.inference_mode():
                for layer in model.layers:
                    layer.mlp(empty)
        return total

    def _run(self, collective, out, inp) -> None:
        """``collective(out, inp)``; through host copies when gloo serves CUDA tensors (``staged``)."""
        if self.closed:
            raise GroupLost(f"expert-parallel group {self.generation} is closed")
        try:
            if not self.staged:
                collective(out, inp)
                return
            host = [o.cpu() for o in out] if isinstance(out, list) else out.cpu()
            collective(host, [i.cpu() for i in inp] if isinstance(inp, list) else inp.cpu())
            for o, h in zip(out, host) if isinstance(out, list) else ((out, host),):
                o.copy_(h)
        except Exception as e:  # gloo: RuntimeError "Connection closed by peer"; NCCL: DistBackendError
            raise GroupLost(f"expert-parallel group {self.generation} lost a member: {e}") from e
