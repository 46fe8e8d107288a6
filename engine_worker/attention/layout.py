"""What one forward step looks like to attention: ``SeqLayout`` in, ``StepLayout`` out.

``plan_tokens`` does the part every backend shares (token order, positions, cache slots, the
prefill spans and their masks); a backend adds its decode plan (``AttentionBackend.plan``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PrefillSpan", "SeqLayout", "StepLayout", "plan_tokens", "slots", "padded_tables"]


@dataclass(frozen=True)
class SeqLayout:
    """One sequence of a step, as the cache needs it."""

    block_table: list[int]
    start_pos: int  # tokens of this sequence already in the cache
    num_tokens: int  # new tokens this step


@dataclass(frozen=True)
class PrefillSpan:
    """One sequence that feeds several tokens this step (a prompt or a chunk of one)."""

    start_pos: int
    num_tokens: int
    offset: int  # index of its first token in the step's flattened token batch
    gather: torch.Tensor | None  # [start+n] slots of its keys when start_pos > 0
    # [n, keys] bool (True = attend) over the gathered keys, or over its own n keys when there
    # is no gather (a sliding window shorter than the prompt); None means plain causal
    mask: torch.Tensor | None


@dataclass(frozen=True)
class StepLayout:
    """How one forward step's tokens are laid out; built by ``AttentionBackend.plan``.

    Tokens are flattened in ``order``: first every decode sequence, then each prefill.
    """

    order: list[int]  # step-local sequence indices in token order
    first_token_index: list[int]  # per caller's sequence index: its first token in the flat batch
    last_token_index: list[int]  # per caller's sequence index: its last token in the flat batch
    positions: torch.Tensor  # [N] absolute position of each token (long)
    slot_mapping: torch.Tensor  # [N] cache slot each token's key/value is stored in (long)
    num_decode: int
    prefills: list[PrefillSpan]
    # Paged decode kernels (native, Triton): block tables [B, blocks] and key counts [B], int32
    decode_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    # Any other backend's own decode plan (gather: a ``GatherPlan``; flex: a block mask)
    decode: object | None = None


def slots(table: list[int], bs: int, start: int, end: int) -> list[int]:
    """Cache slots of positions ``start..end-1`` for a block table."""
    out: list[int] = []
    pos = start
    while pos < end:
        b, off = divmod(pos, bs)
        n = min(bs - off, end - pos)
        base = table[b] * bs + off
        out.extend(range(base, base + n))
        pos += n
    return out


def padded_tables(seqs: list[SeqLayout], nb: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``nb`` blocks of every table, padded with block 0: ``[len(seqs), nb]`` on the CPU."""
    tables = [s.block_table[:nb] for s in seqs]
    return torch.tensor([t + [0] * (nb - len(t)) for t in tables], dtype=dtype)


def plan_tokens(seqs: list[SeqLayout], block_size: int, num_blocks: int, window: int | None,
                device: torch.device) -> tuple[list[int], dict]:
    """Check ``seqs`` and lay out their tokens: ``(decode indices, StepLayout fields)``, the
    fields every backend shares (its decode plan comes on top)."""
    bs = block_size
    for s in seqs:
        if s.num_tokens < 1 or s.start_pos < 0:
            raise ValueError(f"bad step layout {s.start_pos} cached + {s.num_tokens} new tokens")
        if s.start_pos + s.num_tokens > len(s.block_table) * bs:
            raise ValueError(f"{s.start_pos + s.num_tokens} tokens do not fit {len(s.block_table)} KV blocks")
        # The native and Triton kernels index the pool with these ids unchecked.
        if s.block_table and not 0 <= min(s.block_table) <= max(s.block_table) < num_blocks:
            raise ValueError(f"block table {s.block_table} points outside the pool of {num_blocks} blocks")
    decode = [i for i, s in enumerate(seqs) if s.num_tokens == 1]
    prefill = [i for i, s in enumerate(seqs) if s.num_tokens > 1]
    order = decode + prefill

    positions: list[int] = []
    slot_list: list[int] = []
    first = [0] * len(seqs)
    last = [0] * len(seqs)
    prefills: list[PrefillSpan] = []
    for i in order:
        s = seqs[i]
        offset = len(positions)
        end = s.start_pos + s.num_tokens
        positions.extend(range(s.start_pos, end))
        slot_list.extend(slots(s.block_table, bs, s.start_pos, end))
        first[i] = offset
        last[i] = offset + s.num_tokens - 1
        if s.num_tokens > 1:
            gather = mask = None
            if s.start_pos > 0:
                gather = torch.tensor(slots(s.block_table, bs, 0, end), device=device)
            if s.start_pos > 0 or (window is not None and s.num_tokens > window):
                q_pos = torch.arange(s.start_pos, end, device=device)[:, None]
                k_pos = torch.arange(s.start_pos if gather is None else 0, end, device=device)[None, :]
                mask = k_pos <= q_pos
                if window is not None:
                    mask &= k_pos > q_pos - window
            prefills.append(PrefillSpan(s.start_pos, s.num_tokens, offset, gather, mask))
    return decode, dict(
        order=order,
        first_token_index=first,
        last_token_index=last,
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slot_list, dtype=torch.long, device=device),
        num_decode=len(decode),
        prefills=prefills,
    )
