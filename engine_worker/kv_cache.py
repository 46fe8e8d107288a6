"""The KV cache and the attention that reads it, for continuous batching on one device.

Each running sequence owns one *slot*: a fixed row of ``max_model_len`` key/value positions per
layer, allocated once at start-up. This is deliberately simple (a later issue replaces it with a
paged cache); everything the model needs from a cache goes through ``SlotKVCache``:

- ``plan(...)`` turns one step's sequences into a ``StepLayout`` (token order, positions, masks),
  computed once per step and shared by every layer;
- ``attend(layer, q, k, v, layout)`` stores the step's new keys/values and returns the attention
  output for every token of the step.

Decode tokens (one new token per sequence) are attended together in one SDPA call; each prefill
(chunk) is attended on its own with a causal mask. Both read the cache through views, not copies,
whenever the decoding slots form a compact range: on a CPU the copy of a gathered cache costs
more than the attention itself.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillSpan:
    """One sequence that feeds several tokens this step (a prompt or a chunk of one)."""

    slot: int
    start_pos: int  # tokens of this sequence already in the cache
    num_tokens: int  # new tokens this step
    offset: int  # index of its first token in the step's flattened token batch
    mask: torch.Tensor | None  # [n, start+n] bool when start_pos > 0; None means plain causal


@dataclass(frozen=True)
class StepLayout:
    """How one forward step's tokens are laid out; built by ``SlotKVCache.plan``.

    Tokens are flattened in ``order``: first every decode sequence (sorted by slot, so that their
    slots are a contiguous range as often as possible), then each prefill in the caller's order.
    """

    order: list[int]  # step-local sequence indices in token order
    last_token_index: list[int]  # per caller's sequence index: its last token in the flat batch
    positions: torch.Tensor  # [N] absolute position of each token (long)
    write_slots: torch.Tensor  # [N] slot each token's key/value is stored in (long)
    num_decode: int
    # Decode group: read slots [span_start, span_start + span_rows) as one view when compact,
    # otherwise gather ``decode_slots``; ``decode_rows`` picks the batch's rows out of the span.
    decode_slots: torch.Tensor | None
    span_start: int | None
    span_rows: int
    decode_rows: torch.Tensor | None  # None: the span is exactly the decode batch
    decode_len: int  # keys read per decode row (the longest decode context)
    decode_mask: torch.Tensor | None  # [rows, 1, 1, decode_len] bool, True = attend
    prefills: list[PrefillSpan]


class SlotKVCache:
    """Per-slot K/V storage: ``[num_layers, max_num_seqs, num_kv_heads, max_model_len, head_dim]``."""

    def __init__(
        self,
        num_layers: int,
        max_num_seqs: int,
        num_kv_heads: int,
        max_model_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (num_layers, max_num_seqs, num_kv_heads, max_model_len, head_dim)
        # Zeros, not empty: masked-out positions are still multiplied by a zero weight inside
        # SDPA, and a NaN bit pattern left in uninitialised memory would poison the row.
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.device = device
        self._free: list[int] = list(range(max_num_seqs))  # a heap: lowest slot first keeps decodes compact
        self._used: set[int] = set()

    @staticmethod
    def bytes_needed(num_layers: int, max_num_seqs: int, num_kv_heads: int, max_model_len: int,
                     head_dim: int, dtype: torch.dtype) -> int:
        """Memory the cache will take, so a caller can check before allocating."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * max_num_seqs * num_kv_heads * max_model_len * head_dim * elem

    # -- slots -------------------------------------------------------------------------------

    @property
    def num_used(self) -> int:
        return len(self._used)

    def allocate(self) -> int | None:
        """The lowest free slot, or None when every slot is taken."""
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back. Its stale contents need no clearing: reads are length-masked."""
        if slot not in self._used:
            raise ValueError(f"KV slot {slot} is not allocated")
        self._used.remove(slot)
        heapq.heappush(self._free, slot)

    def is_allocated(self, slot: int) -> bool:
        return slot in self._used

    # -- one step ----------------------------------------------------------------------------

    def plan(self, seqs: list[tuple[int, int, int]]) -> StepLayout:
        """Lay out one step. ``seqs`` holds ``(slot, start_pos, num_new_tokens)`` per sequence."""
        seen: set[int] = set()
        for slot, start, n in seqs:
            if slot not in self._used:
                raise ValueError(f"KV slot {slot} is not allocated")
            if slot in seen:
                raise ValueError(f"KV slot {slot} appears twice in one step")
            seen.add(slot)
            if n < 1 or start < 0 or start + n > self.max_model_len:
                raise ValueError(
                    f"slot {slot}: {start} cached + {n} new tokens does not fit max_model_len={self.max_model_len}"
                )

        decode = sorted((i for i, (_, _, n) in enumerate(seqs) if n == 1), key=lambda i: seqs[i][0])
        prefill = [i for i, (_, _, n) in enumerate(seqs) if n > 1]
        order = decode + prefill

        positions: list[int] = []
        write_slots: list[int] = []
        last = [0] * len(seqs)
        prefills: list[PrefillSpan] = []
        for i in order:
            slot, start, n = seqs[i]
            offset = len(positions)
            positions.extend(range(start, start + n))
            write_slots.extend([slot] * n)
            last[i] = offset + n - 1
            if n > 1:
                mask = None
                if start > 0:
                    # Query i (absolute position start+i) sees keys 0..start+i.
                    q_pos = torch.arange(start, start + n, device=self.device)[:, None]
                    mask = torch.arange(start + n, device=self.device)[None, :] <= q_pos
                prefills.append(PrefillSpan(slot, start, n, offset, mask))

        dev = self.device
        layout_kw: dict = dict(decode_slots=None, span_start=None, span_rows=0, decode_rows=None,
                               decode_len=0, decode_mask=None)
        if decode:
            slots = [seqs[i][0] for i in decode]
            lens = [seqs[i][1] + 1 for i in decode]
            width = max(lens)
            lo, hi = slots[0], slots[-1] + 1
            if hi - lo <= 2 * len(slots):
                # Compact enough: read the whole slot range as a view and pad the query rows of
                # the slots that are not decoding this step (they attend to position 0 only, so
                # their rows stay finite and are dropped afterwards).
                row_lens = [1] * (hi - lo)
                for s, ln in zip(slots, lens):
                    row_lens[s - lo] = ln
                layout_kw.update(span_start=lo, span_rows=hi - lo)
                if hi - lo != len(slots):
                    layout_kw["decode_rows"] = torch.tensor([s - lo for s in slots], device=dev)
            else:
                row_lens = lens
                layout_kw.update(decode_slots=torch.tensor(slots, device=dev), span_rows=len(slots))
            row_lens_t = torch.tensor(row_lens, device=dev)
            layout_kw["decode_mask"] = (torch.arange(width, device=dev)[None, :] < row_lens_t[:, None])[:, None, None, :]
            layout_kw["decode_len"] = width

        return StepLayout(
            order=order,
            last_token_index=last,
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            write_slots=torch.tensor(write_slots, dtype=torch.long, device=dev),
            num_decode=len(decode),
            prefills=prefills,
            **layout_kw,
        )

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: StepLayout) -> torch.Tensor:
        """Store this step's ``k``/``v`` ([N, kv_heads, D]) and attend ``q`` ([N, heads, D]).

        Returns ``[N, heads * D]`` in the step's token order.
        """
        ck, cv = self.k[layer], self.v[layer]
        ck[layout.write_slots, :, layout.positions] = k
        cv[layout.write_slots, :, layout.positions] = v

        n_tokens, n_heads, head_dim = q.shape
        n_kv = ck.shape[1]
        outs: list[torch.Tensor] = []
        if layout.num_decode:
            outs.append(self._attend_decode(ck, cv, q[: layout.num_decode], layout, n_kv))
        for p in layout.prefills:
            qp = q[p.offset : p.offset + p.num_tokens].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            end = p.start_pos + p.num_tokens
            kp = ck[p.slot, :, :end].unsqueeze(0)  # a view: [1, KV, end, D]
            vp = cv[p.slot, :, :end].unsqueeze(0)
            if p.mask is None:
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, enable_gqa=True)
            outs.append(o[0].transpose(0, 1).reshape(p.num_tokens, n_heads * head_dim))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @staticmethod
    def _attend_decode(ck: torch.Tensor, cv: torch.Tensor, q: torch.Tensor, layout: StepLayout, n_kv: int) -> torch.Tensor:
        b, n_heads, head_dim = q.shape
        # One query per sequence: fold the query heads of each KV group into the "query length"
        # axis, so grouped-query attention needs neither repeat_interleave nor enable_gqa.
        qg = q.view(b, n_kv, n_heads // n_kv, head_dim)
        width = layout.decode_len
        if layout.span_start is not None:
            lo = layout.span_start
            kd = ck[lo : lo + layout.span_rows, :, :width]
            vd = cv[lo : lo + layout.span_rows, :, :width]
            if layout.decode_rows is not None:
                padded = qg.new_zeros((layout.span_rows, *qg.shape[1:]))
                padded[layout.decode_rows] = qg
                qg = padded
        else:
            kd = ck[layout.decode_slots, :, :width]
            vd = cv[layout.decode_slots, :, :width]
        o = F.scaled_dot_product_attention(qg, kd, vd, attn_mask=layout.decode_mask)
        if layout.decode_rows is not None:
            o = o[layout.decode_rows]
        return o.reshape(b, n_heads * head_dim)
