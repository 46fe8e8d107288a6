"""The paged KV cache tensors and the attention that reads them.

Storage per layer is ``[num_kv_heads, num_blocks * block_size, head_dim]`` for keys and the same
for values: a token at position ``p`` of a request lives in slot ``table[p // bs] * bs + p % bs``.
``BlockManager`` decides which blocks a request holds; this module only moves tensors.

- ``plan(...)`` turns one step's sequences into a ``StepLayout`` (token order, positions, slot
  mapping, gather indices, masks), computed once per step and shared by every layer;
- ``attend(layer, q, k, v, layout)`` stores the step's new keys/values and returns the attention
  output for every token of the step.

Decode tokens (one new token per sequence) are attended together by a paged kernel that reads
the blocks in place through int32 block tables: ``cpu_kernels`` on a CPU, ``triton_attention`` on
CUDA (static shapes, so a decode step can be a CUDA graph). Without them: FlexAttention over the
pool on CUDA, or keys gathered through the block tables (SDPA for small batches, two batched
matmuls with an fp32 softmax for larger ones; a lone decoder whose blocks are consecutive reads
a view). A prefill that starts at position 0 attends to its own new keys directly, causally; one
that continues a cached prefix (a chunk, or a prefix-cache hit) gathers that prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_worker import cpu_kernels, triton_attention

# Decode batches up to this size use SDPA; larger ones two batched matmuls (faster on CPUs).
SDPA_MAX_DECODE_BATCH = 8


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
    """How one forward step's tokens are laid out; built by ``PagedKVCache.plan``.

    Tokens are flattened in ``order``: first every decode sequence, then each prefill.
    """

    order: list[int]  # step-local sequence indices in token order
    first_token_index: list[int]  # per caller's sequence index: its first token in the flat batch
    last_token_index: list[int]  # per caller's sequence index: its last token in the flat batch
    positions: torch.Tensor  # [N] absolute position of each token (long)
    slot_mapping: torch.Tensor  # [N] cache slot each token's key/value is stored in (long)
    num_decode: int
    decode_len: int  # keys read per decode row (the longest decode context)
    decode_view: tuple[int, int] | None  # (first slot, length): a lone decoder reads a view
    decode_gather: torch.Tensor | None  # [2 * KV * B * blocks] rows of the (k|v, head, block) view
    decode_mask: torch.Tensor | None  # [1, B, 1, decode_len] bool, True = attend (False: padding)
    prefills: list[PrefillSpan]
    # Native CPU decode (cpu_kernels): block tables [B, blocks] and key counts [B], int32
    decode_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    # CUDA FlexAttention decode (None elsewhere)
    flex: object | None = None


class PagedKVCache:
    """K/V pools ``[num_layers, num_kv_heads, num_blocks * block_size, head_dim]``."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, num_heads: int | None = None,
                 sliding_window: int | None = None):
        # Keys and values of a layer side by side, so one gather fetches both.
        # Zeros, not empty: padded (masked) key rows are still multiplied by a zero weight in
        # attention, and a NaN bit pattern left in uninitialised memory would poison the row.
        self.kv = torch.zeros((num_layers, 2, num_kv_heads, num_blocks * block_size, head_dim), dtype=dtype, device=device)
        self.k = self.kv[:, 0]  # views: [num_layers, num_kv_heads, slots, head_dim]
        self.v = self.kv[:, 1]
        self.num_kv_heads = num_kv_heads
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, not {sliding_window}")
        # Sliding-window attention (Mistral): a query at position p sees keys p-W+1 .. p.
        self.window = sliding_window
        # The FlexAttention mask reads the pool in physical order and knows no positions, so a
        # windowed model keeps the gather path on CUDA.
        heads = num_heads or num_kv_heads
        self.use_native = cpu_kernels.supports(device, dtype, heads, num_kv_heads, head_dim)
        # CUDA: Triton's paged kernel when it passes its self-check, else FlexAttention (not for
        # windowed models), else the gather path.
        self.use_triton = (device.type == "cuda" and triton_attention.available()
                           and triton_attention.self_check(device, dtype, heads, num_kv_heads, head_dim, block_size,
                                                           sliding_window))
        self.use_flex = (device.type == "cuda" and not self.use_triton and sliding_window is None
                         and _flex_available())
        self.sdpa_max_decode_batch = SDPA_MAX_DECODE_BATCH
        self.paged_kernel = cpu_kernels if device.type == "cpu" else triton_attention
        # Per layer (kv [2, KV, slots, D], k, v), made once: a step would otherwise pay three
        # tensor views per layer just to find its slice of the pool.
        self.layer_views = [(self.kv[i], self.k[i], self.v[i]) for i in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

    # -- one step ----------------------------------------------------------------------------

    def plan(self, seqs: list[SeqLayout]) -> StepLayout:
        bs = self.block_size
        for s in seqs:
            if s.num_tokens < 1 or s.start_pos < 0:
                raise ValueError(f"bad step layout {s.start_pos} cached + {s.num_tokens} new tokens")
            if s.start_pos + s.num_tokens > len(s.block_table) * bs:
                raise ValueError(f"{s.start_pos + s.num_tokens} tokens do not fit {len(s.block_table)} KV blocks")
            # The native and Triton kernels index the pool with these ids unchecked.
            if s.block_table and not 0 <= min(s.block_table) <= max(s.block_table) < self.num_blocks:
                raise ValueError(f"block table {s.block_table} points outside the pool of {self.num_blocks} blocks")
        decode = [i for i, s in enumerate(seqs) if s.num_tokens == 1]
        prefill = [i for i, s in enumerate(seqs) if s.num_tokens > 1]
        order = decode + prefill

        positions: list[int] = []
        slots: list[int] = []
        first = [0] * len(seqs)
        last = [0] * len(seqs)
        prefills: list[PrefillSpan] = []
        dev = self.device
        for i in order:
            s = seqs[i]
            offset = len(positions)
            end = s.start_pos + s.num_tokens
            positions.extend(range(s.start_pos, end))
            slots.extend(_slots(s.block_table, bs, s.start_pos, end))
            first[i] = offset
            last[i] = offset + s.num_tokens - 1
            if s.num_tokens > 1:
                gather = mask = None
                if s.start_pos > 0:
                    gather = torch.tensor(_slots(s.block_table, bs, 0, end), device=dev)
                if s.start_pos > 0 or (self.window is not None and s.num_tokens > self.window):
                    q_pos = torch.arange(s.start_pos, end, device=dev)[:, None]
                    k_pos = torch.arange(s.start_pos if gather is None else 0, end, device=dev)[None, :]
                    mask = k_pos <= q_pos
                    if self.window is not None:
                        mask &= k_pos > q_pos - self.window
                prefills.append(PrefillSpan(s.start_pos, s.num_tokens, offset, gather, mask))

        kw: dict = dict(decode_len=0, decode_view=None, decode_gather=None, decode_mask=None)
        if decode:
            lens = [seqs[i].start_pos + 1 for i in decode]
            width = max(lens)
            kw["decode_len"] = width
            table0 = seqs[decode[0]].block_table
            nb = -(-width // bs)
            if self.use_native or self.use_triton:
                tables = [seqs[i].block_table[:nb] for i in decode]
                kw["decode_tables"] = torch.tensor([t + [0] * (nb - len(t)) for t in tables], dtype=torch.int32).to(dev)
                kw["decode_lens"] = torch.tensor(lens, dtype=torch.int32).to(dev)
            elif len(decode) == 1 and all(table0[j] == table0[0] + j for j in range(nb)):
                skip = max(0, width - self.window) if self.window is not None else 0
                kw["decode_view"] = (table0[0] * bs + skip, width - skip)
            else:
                # Whole blocks of every row (tables padded with block 0), for keys and values
                # of every KV head at once: one gather of block-sized rows per layer. Positions
                # past a row's length are masked out.
                tables = [seqs[i].block_table[:nb] for i in decode]
                bt = torch.tensor([t + [0] * (nb - len(t)) for t in tables], dtype=torch.long).view(-1)
                planes = torch.arange(2 * self.num_kv_heads)[:, None] * self.num_blocks
                kw["decode_gather"] = (planes + bt[None, :]).view(-1).to(dev)
                kw["decode_len"] = width = nb * bs
                windowed = self.window is not None and max(lens) > self.window
                if windowed or any(ln != width for ln in lens):
                    lt = torch.tensor(lens, device=dev)[:, None]
                    k_pos = torch.arange(width, device=dev)[None, :]
                    mask = k_pos < lt
                    if windowed:
                        mask &= k_pos >= lt - self.window
                    kw["decode_mask"] = mask[None, :, None, :]
            if self.use_flex:
                kw["flex"] = _flex_decode_plan(self, [seqs[i] for i in decode], lens)

        return StepLayout(
            order=order,
            first_token_index=first,
            last_token_index=last,
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decode=len(decode),
            prefills=prefills,
            **kw,
        )

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: StepLayout,
               stored: bool = False) -> torch.Tensor:
        """Store this step's ``k``/``v`` ([N, kv_heads, D]) and attend ``q`` ([N, heads, D]).

        ``stored``: the caller already wrote them (``cpu_kernels.rope_and_store``).
        Returns ``[N, heads * D]`` in the step's token order.
        """
        kv_layer, ck, cv = self.layer_views[layer]
        if not stored:
            ck.index_copy_(1, layout.slot_mapping, k.transpose(0, 1))
            cv.index_copy_(1, layout.slot_mapping, v.transpose(0, 1))

        n_tokens, n_heads, head_dim = q.shape
        outs: list[torch.Tensor] = []
        if layout.num_decode:
            qd = q if layout.num_decode == n_tokens else q[: layout.num_decode]
            if layout.decode_tables is not None:
                outs.append(self.paged_kernel.decode_attention(qd, kv_layer, layout.decode_tables, layout.decode_lens,
                                                               self.block_size, head_dim ** -0.5, self.window))
            elif layout.flex is not None:
                outs.append(flex_decode(ck, cv, qd, layout.flex))
            else:
                kv_blocks = kv_layer.view(-1, self.block_size * head_dim)  # [(2 * KV * blocks), bs * D]
                outs.append(self._attend_decode(ck, cv, kv_blocks, qd, layout, self.num_kv_heads,
                                                self.sdpa_max_decode_batch))
        for p in layout.prefills:
            qp = q[p.offset : p.offset + p.num_tokens].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if p.gather is None:
                kp = k[p.offset : p.offset + p.num_tokens].transpose(0, 1).unsqueeze(0)  # [1, KV, n, D]
                vp = v[p.offset : p.offset + p.num_tokens].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=p.mask is None, attn_mask=p.mask,
                                                   enable_gqa=True)
            else:
                kp = ck.index_select(1, p.gather).unsqueeze(0)
                vp = cv.index_select(1, p.gather).unsqueeze(0)
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, enable_gqa=True)
            outs.append(o[0].transpose(0, 1).reshape(p.num_tokens, n_heads * head_dim))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @staticmethod
    def _attend_decode(ck: torch.Tensor, cv: torch.Tensor, kv_blocks: torch.Tensor, q: torch.Tensor,
                       layout: StepLayout, n_kv: int, sdpa_max_batch: int) -> torch.Tensor:
        b, n_heads, head_dim = q.shape
        # One query per sequence: fold the query heads of each KV group into the "query length"
        # axis, so grouped-query attention needs no repeat_interleave. The batch axes are
        # (kv head, sequence) because that is the order the gathered keys come out in, so the
        # matmuls read them without a copy.
        qg = q.view(b, n_kv, n_heads // n_kv, head_dim).transpose(0, 1)  # [KV, B, G, D]
        width = layout.decode_len
        if layout.decode_view is not None:
            s0, ln = layout.decode_view
            kd = ck[:, s0 : s0 + ln].unsqueeze(1)  # [KV, 1, L, D], a view
            vd = cv[:, s0 : s0 + ln].unsqueeze(1)
        else:
            both = kv_blocks.index_select(0, layout.decode_gather).view(2, n_kv, b, width, head_dim)
            kd, vd = both[0], both[1]
        if b <= sdpa_max_batch:
            o = F.scaled_dot_product_attention(qg, kd, vd, attn_mask=layout.decode_mask)
        else:
            # Plain matmuls for larger batches: with one query row per head group, CPU SDPA
            # spends more on setup than on math (measured 2x slower in bf16 at 32 x 200 keys).
            # Scores and softmax in fp32 whatever the cache dtype, as attention kernels do.
            scores = torch.matmul(qg, kd.transpose(-1, -2)).float().mul_(head_dim ** -0.5)  # [KV, B, G, L]
            if layout.decode_mask is not None:
                scores.masked_fill_(~layout.decode_mask, float("-inf"))
            o = torch.matmul(scores.softmax(dim=-1).to(vd.dtype), vd)  # [KV, B, G, D]
        return o.transpose(0, 1).reshape(b, n_heads * head_dim)


def reference_decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, tables, lens, block_size: int,
                               window: int | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Decode attention written out row by row on the CPU in ``dtype``, straight from the block
    tables: the oracle every paged kernel is checked against (tests, Triton's start-up check).

    ``q`` [B, H, D]; ``kv_layer`` [2, KV, slots, D]; ``tables``/``lens`` per row (lists or tensors).
    """
    q, kv_layer = q.to("cpu", dtype), kv_layer.to("cpu", dtype)
    n_kv, d = kv_layer.shape[1], q.shape[-1]
    rows = []
    for r in range(q.shape[0]):
        n = int(lens[r])
        first = max(0, n - window) if window else 0
        slots = [int(tables[r][p // block_size]) * block_size + p % block_size for p in range(first, n)]
        k, v = kv_layer[0][:, slots], kv_layer[1][:, slots]  # [KV, L, D]
        heads = q[r].view(n_kv, -1, d)  # [KV, G, D]
        w = (heads @ k.transpose(-1, -2) * d ** -0.5).softmax(-1)
        rows.append((w @ v).reshape(-1))
    return torch.stack(rows)


def _slots(table: list[int], bs: int, start: int, end: int) -> list[int]:
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


# -- CUDA: FlexAttention over the paged pool ---------------------------------------------------
#
# Each decode query attends to the pool directly: a block mask says which pool slots each row
# may read (the blocks of its table, and in its last block only the filled positions), so no
# per-step copy of the cache is made. Key order does not matter to attention (keys carry their
# rotary position already), so the mask needs no logical-to-physical reordering. Only used when
# the cache lives on a CUDA device and FlexAttention imports; the CPU never takes this path
# (tests run the same mask eagerly on the CPU to check it against the gather path).

_FLEX: tuple | None = None


def _flex_available() -> bool:
    global _FLEX
    if _FLEX is None:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            _FLEX = (torch.compile(flex_attention, dynamic=True), create_block_mask)
        except Exception:  # pragma: no cover - depends on the torch build
            _FLEX = ()
    return bool(_FLEX)


def flex_decode_mask(num_blocks: int, block_size: int, seqs: list[SeqLayout], lens: list[int], device: torch.device):
    """The FlexAttention block mask for one step's decode rows over the whole pool."""
    from torch.nn.attention.flex_attention import create_block_mask

    b = len(seqs)
    allowed = torch.zeros((b, num_blocks), dtype=torch.bool)
    last_block = torch.empty(b, dtype=torch.long)
    last_fill = torch.empty(b, dtype=torch.long)
    for row, (s, ln) in enumerate(zip(seqs, lens)):
        used = -(-ln // block_size)
        allowed[row, torch.tensor(s.block_table[:used])] = True
        last_block[row] = s.block_table[used - 1]
        last_fill[row] = ln - (used - 1) * block_size
    allowed, last_block, last_fill = allowed.to(device), last_block.to(device), last_fill.to(device)

    def mask_mod(bi, h, q_idx, kv_idx):
        blk = kv_idx // block_size
        return allowed[bi, blk] & ((blk != last_block[bi]) | (kv_idx % block_size < last_fill[bi]))

    return create_block_mask(mask_mod, B=b, H=None, Q_LEN=1, KV_LEN=num_blocks * block_size, device=device)


def _flex_decode_plan(cache: PagedKVCache, seqs: list[SeqLayout], lens: list[int]):  # pragma: no cover - CUDA
    try:
        return flex_decode_mask(cache.num_blocks, cache.block_size, seqs, lens, cache.device)
    except Exception:  # any trouble: the gather path is always there
        cache.use_flex = False
        return None


def flex_decode(ck: torch.Tensor, cv: torch.Tensor, q: torch.Tensor, block_mask, attention=None) -> torch.Tensor:
    """Decode attention of ``q`` ([B, H, D]) over the pool ``ck``/``cv`` ([KV, S, D])."""
    if attention is None:
        attention = _FLEX[0]  # type: ignore[index]
    b, n_heads, head_dim = q.shape
    o = attention(q[:, :, None, :], ck.unsqueeze(0).expand(b, -1, -1, -1), cv.unsqueeze(0).expand(b, -1, -1, -1),
                  block_mask=block_mask, enable_gqa=True)
    return o.reshape(b, n_heads * head_dim)
