"""Turn one step's logits into tokens for a mixed batch of requests, vectorised over rows.

Order of operations (as vLLM's V1 sampler does):

0. structured output: tokens the request's grammar does not allow get -inf (``grammar.fill_masks``);
1. ``logit_bias`` and the ``min_tokens`` mask (EOS and ``stop_token_ids`` get -inf until the
   request has produced ``min_tokens`` tokens);
2. penalties: repetition over prompt + output tokens (divide positive logits, multiply negative
   ones), then frequency (x count) and presence (x seen) over output tokens only;
3. greedy rows (temperature 0, or top_k 1) take the argmax here;
4. temperature, then min_p, top_k and top_p truncation;
5. a draw by inverse CDF: one uniform ``u`` per row, and the first kept token whose cumulative
   weight exceeds ``u`` x the kept total. Rows without top_k / top_p walk the whole vocabulary
   in token order; top_k / top_p rows walk their kept tokens best first, found among the
   ``topk`` of max(top_k, 256) candidates, with a full sort only for rows whose candidates hold
   less than top_p of the mass. A seeded request's ``u`` is a function of its seed and the
   position of the token drawn (``seeded_uniform``), so its tokens depend on neither its batch
   mates nor the engine: a request moved to another engine after n tokens (a migration, which
   brings those tokens along) draws the same token n + 1 as it would have where it was. Unseeded
   rows share one ``torch.Generator``.

Prompt logprobs (``prompt_logprobs=k``) are ``log_softmax`` of the raw logits at each prompt
position, for the prompt token that follows it, plus the top k: the model's own distribution,
untouched by the request's sampling settings (as vLLM reports them).

Logprobs (our choice, documented for the API layer): ``log_softmax`` of the logits after steps
1, 2 and temperature, *before* top-k/top-p/min-p truncation. That is the model's distribution as
shaped by the request's penalties and temperature: the sampled token's logprob is finite even
under truncation, and the top-k alternatives are real alternatives rather than -inf. (vLLM V0
returned the post-truncation distribution; V1 returns raw logits by default.) Greedy rows skip
temperature, so theirs are ``log_softmax`` of the penalised logits.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine_worker.grammar import GrammarHandle, fill_masks
from protocol.messages import SamplingParams


class SamplingRow(Protocol):
    """What the sampler reads of a sequence (``runner.SeqInput`` has these fields)."""

    sampling: SamplingParams
    prompt_ids: list[int]
    past_output_ids: list[int]
    grammar: GrammarHandle | None


@dataclass
class PromptLogprobs:
    """Logprobs of consecutive prompt tokens (each given the tokens before it)."""

    logprobs: list[float]
    top_ids: list[list[int]]  # per token, the k most likely ids, best first
    top_logprobs: list[list[float]]
    ranks: list[int]  # per token, its rank in the distribution (1 = most likely; ties count against it, as vLLM's)


@dataclass
class SampleOut:
    token_id: int | None  # None when only prompt logprobs were computed (a non-final chunk)
    logprob: float | None  # None unless the request asked for logprobs
    top_ids: list[int] | None  # the ``logprobs`` most likely ids, best first
    top_logprobs: list[float] | None
    prompt: PromptLogprobs | None = None
    pooled: torch.Tensor | None = None  # an embedding request: the final-norm hidden state of its last token


def _pad(rows: list[Sequence[int]], fill: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), fill, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out.to(device)


def _token_counts(rows: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(rows), vocab]`` occurrence counts; ids outside the vocabulary are ignored."""
    ids = _pad(rows, vocab, device).clamp_(0, vocab)  # pads (and strays) land in a spare column
    counts = torch.zeros((len(rows), vocab + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def _plain_greedy(row: SamplingRow) -> bool:
    """Greedy, with no bias, penalty, min_tokens mask or logprobs to apply first."""
    p = row.sampling
    return (p.greedy and row.grammar is None and not p.logit_bias and p.logprobs is None and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty and len(row.past_output_ids) >= p.min_tokens)


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], device: torch.device, seed: int | None = None):
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        # Unseeded rows share this generator; seeded from the OS so engines do not repeat each other.
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)

    def seed_shared(self, seed: int) -> None:
        """Make unseeded requests reproducible (``--seed``): the shared generator starts from ``seed``."""
        self._shared.manual_seed(seed)

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
               allowed: torch.Tensor | None = None) -> list[SampleOut]:
        """One token per row of ``logits`` ([B, V]); ``logits`` may be modified in place.
        ``allowed``: the grammar masks of the constrained rows, in row order, when the caller has
        computed them already (``grammar.start_masks``); else they are computed here."""
        b, vocab = logits.shape
        if b != len(rows):
            raise ValueError(f"{b} logit rows for {len(rows)} sequences")
        if b == 0:
            return []
        params = [r.sampling for r in rows]
        logits = logits.float()  # (also faster: torch's CPU argmax over bf16 is ~4x slower than over fp32)
        if all(_plain_greedy(r) for r in rows):
            # Nothing to add to the logits and nothing to report but the argmax.
            return [SampleOut(t, None, None, None) for t in logits.argmax(dim=-1).tolist()]
        dev = logits.device

        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if constrained:
            if allowed is None:
                allowed = fill_masks([rows[i].grammar for i in constrained], vocab)
            allowed = allowed.to(dev)
            if len(constrained) == b:
                logits.masked_fill_(~allowed, float("-inf"))
            else:
                logits[constrained] = logits[constrained].masked_fill_(~allowed, float("-inf"))
        self._apply_bias_and_min_tokens(logits, rows, vocab)
        self._apply_penalties(logits, rows, vocab)
        if constrained:
            # Rows that can be left with no finite logit: an empty grammar mask, or min_tokens
            # banning the only tokens the grammar allows (a -100 bias leaves logits finite).
            at_risk = {j for j, i in enumerate(constrained) if len(rows[i].past_output_ids) < params[i].min_tokens}
            at_risk.update((~allowed.any(dim=-1)).nonzero()[:, 0].tolist())
            if at_risk:
                at_risk = sorted(at_risk)
                self._revive_dead_rows(logits, [constrained[j] for j in at_risk], allowed[at_risk])

        greedy = [p.greedy for p in params]
        tokens = torch.empty(b, dtype=torch.long, device=dev)
        g_idx = [i for i in range(b) if greedy[i]]
        if len(g_idx) == b:
            tokens = logits.argmax(dim=-1)  # the common all-greedy batch: no row copy
        elif g_idx:
            tokens[g_idx] = logits[g_idx].argmax(dim=-1)

        temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
        if any(t != 1.0 for t in temps):
            logits.div_(torch.tensor(temps, device=dev)[:, None])

        lp_idx = [i for i in range(b) if params[i].logprobs is not None]
        logprobs = torch.log_softmax(logits[lp_idx], dim=-1) if lp_idx else None

        s_idx = [i for i in range(b) if not greedy[i]]
        if len(s_idx) == b:
            tokens = self._draw(logits, rows)  # the common all-sampled batch: no row copy
        elif s_idx:
            tokens[s_idx] = self._draw(logits[s_idx], [rows[i] for i in s_idx])

        token_list = tokens.tolist()
        outs = [SampleOut(t, None, None, None) for t in token_list]
        if logprobs is not None:
            kmax = max(params[i].logprobs for i in lp_idx)
            chosen = logprobs.gather(1, tokens[lp_idx][:, None])[:, 0].tolist()
            top_v, top_i = (logprobs.topk(kmax, dim=-1) if kmax else (None, None))
            for j, i in enumerate(lp_idx):
                k = params[i].logprobs
                outs[i].logprob = chosen[j]
                outs[i].top_ids = top_i[j, :k].tolist() if k else []
                outs[i].top_logprobs = top_v[j, :k].tolist() if k else []
        return outs

    def prompt_logprobs(self, logits: torch.Tensor, targets: Sequence[int], k: int) -> PromptLogprobs:
        """Row j of ``logits`` ([n, V], raw) scored against prompt token ``targets[j]``."""
        lp = torch.log_softmax(logits.float(), dim=-1)
        picked = lp.gather(1, torch.tensor(list(targets), device=lp.device)[:, None])
        ranks = (lp >= picked).sum(dim=-1).tolist()
        chosen = picked[:, 0].tolist()
        if k:
            top_v, top_i = lp.topk(k, dim=-1)
            return PromptLogprobs(chosen, top_i.tolist(), top_v.tolist(), ranks)
        return PromptLogprobs(chosen, [[] for _ in chosen], [[] for _ in chosen], ranks)

    # -- steps ---------------------------------------------------------------------------------

    def _apply_bias_and_min_tokens(self, logits: torch.Tensor, rows: Sequence[SamplingRow], vocab: int) -> None:
        b_rows: list[int] = []
        b_cols: list[int] = []
        b_vals: list[float] = []
        m_rows: list[int] = []
        m_cols: list[int] = []
        for i, r in enumerate(rows):
            p = r.sampling
            for tok, bias in p.logit_bias:
                if tok < vocab:  # the gateway validates ids; never index out of range here
                    b_rows.append(i)
                    b_cols.append(tok)
                    b_vals.append(bias)
            if len(r.past_output_ids) < p.min_tokens:
                banned = set(p.stop_token_ids)
                if not p.ignore_eos:
                    banned.update(self.eos_token_ids)
                for tok in banned:
                    if tok < vocab:
                        m_rows.append(i)
                        m_cols.append(tok)
        dev = logits.device
        if b_rows:
            idx = (torch.tensor(b_rows, device=dev), torch.tensor(b_cols, device=dev))
            logits.index_put_(idx, torch.tensor(b_vals, dtype=logits.dtype, device=dev), accumulate=True)
        if m_rows:
            logits[torch.tensor(m_rows, device=dev), torch.tensor(m_cols, device=dev)] = float("-inf")

    @staticmethod
    def _revive_dead_rows(logits: torch.Tensor, constrained: list[int], allowed: torch.Tensor) -> None:
        """A constrained row left with no finite logit (min_tokens or a -100 bias took the only
        tokens its grammar allows) samples among the grammar's tokens alone: the grammar wins. A row
        whose grammar allows nothing draws any token, which the scheduler then ends as a dead end."""
        sub = logits[constrained]
        dead = torch.isneginf(sub).all(dim=-1)
        if not bool(dead.any()):
            return
        revived = torch.zeros_like(sub[dead]).masked_fill_(~allowed[dead], float("-inf"))
        revived[~allowed[dead].any(dim=-1)] = 0.0
        sub[dead] = revived
        logits[constrained] = sub

    def _apply_penalties(self, logits: torch.Tensor, rows: Sequence[SamplingRow], vocab: int) -> None:
        idx = [i for i, r in enumerate(rows)
               if r.sampling.repetition_penalty != 1.0 or r.sampling.presence_penalty or r.sampling.frequency_penalty]
        if not idx:
            return
        dev = logits.device
        sub = logits[idx]
        counts = _token_counts([rows[i].past_output_ids for i in idx], vocab, dev)
        rep = [rows[i].sampling.repetition_penalty for i in idx]
        if any(r != 1.0 for r in rep):
            seen = (counts > 0) | (_token_counts([rows[i].prompt_ids for i in idx], vocab, dev) > 0)
            r = torch.tensor(rep, device=dev)[:, None]
            sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
        freq = torch.tensor([rows[i].sampling.frequency_penalty for i in idx], device=dev)[:, None]
        pres = torch.tensor([rows[i].sampling.presence_penalty for i in idx], device=dev)[:, None]
        sub = sub - freq * counts - pres * (counts > 0).float()
        logits[idx] = sub

    def _uniforms(self, rows: Sequence[SamplingRow], dev: torch.device) -> torch.Tensor:
        """One uniform in [0, 1) per row: a seeded row's from its seed and position (``seeded_uniform``), the
        rest from the shared generator (in row order)."""
        seeds = [r.sampling.seed for r in rows]
        if all(s is None for s in seeds):
            return torch.rand(len(rows), generator=self._shared, device=dev, dtype=torch.float64)
        shared = iter(torch.rand(sum(s is None for s in seeds), generator=self._shared, dtype=torch.float64,
                                 device=dev).tolist())
        u = [next(shared) if s is None else seeded_uniform(s, len(r.past_output_ids)) for s, r in zip(seeds, rows)]
        return torch.tensor(u, dtype=torch.float64, device=dev)

    def _draw(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Sample one token per row of (temperature-scaled) ``logits`` after min_p/top-k/top-p,
        by inverse CDF: one uniform per row against the cumulative mass of the kept tokens."""
        n, vocab = logits.shape
        params = [r.sampling for r in rows]
        dev = logits.device
        u = self._uniforms(rows, dev)
        ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        trunc = [i for i, p in enumerate(params) if ks[i] or p.top_p < 1.0]
        full = [i for i in range(n) if not (ks[i] or params[i].top_p < 1.0)]
        tokens = torch.empty(n, dtype=torch.long, device=dev)
        if len(full) == n:
            tokens = self._draw_full(logits, [p.min_p for p in params], u)
        elif full:
            tokens[full] = self._draw_full(logits[full], [params[i].min_p for i in full], u[full])
        if not trunc:
            return tokens
        sub = logits if len(trunc) == n else logits[trunc]
        # softmax makes the probabilities in two passes over memory.
        probs = torch.softmax(sub, dim=-1)
        top_k = torch.tensor([ks[i] for i in trunc], device=dev)
        top_p = torch.tensor([params[i].top_p for i in trunc], dtype=torch.float64, device=dev)
        min_p = [params[i].min_p for i in trunc]
        # The mass top_p is measured against: what min_p and top_k leave. Rows with a top_k hold all
        # of theirs among the candidates; the others hold the whole row's (1, less what min_p drops).
        total = torch.ones(len(trunc), dtype=torch.float64, device=dev)
        min_p_no_k = [j for j, i in enumerate(trunc) if not ks[i] and min_p[j] > 0]
        if min_p_no_k:
            pr = probs[min_p_no_k]
            floor = torch.tensor([min_p[j] for j in min_p_no_k], device=dev)[:, None] * pr.amax(dim=-1, keepdim=True)
            total[min_p_no_k] = pr.masked_fill(pr < floor, 0.0).sum(dim=-1, dtype=torch.float64)
        # Candidates: the best top_k tokens, or (rows with top_p alone) the best _CANDIDATES[0],
        # rather than a full sort; rows whose candidates hold less than their top_p of the mass try
        # the next size, then a sort.
        out = torch.empty(len(trunc), dtype=torch.long, device=dev)
        todo = list(range(len(trunc)))
        for size in _CANDIDATES:
            need = max(ks[trunc[j]] or size for j in todo)
            kc = min(vocab, need)
            part = sub if len(todo) == len(trunc) else sub[todo]
            # Ranked by logit, not probability: nearly equal logits can round to equal probabilities,
            # and ties must not be broken differently by topk sizes that depend on the batch.
            ids = part.topk(kc, dim=-1).indices if kc < vocab else part.argsort(dim=-1, descending=True)
            vals = (probs if len(todo) == len(trunc) else probs[todo]).gather(1, ids)
            keep, w, mass = _truncate(vals, top_k[todo], top_p[todo], [min_p[j] for j in todo], total[todo], dev)
            done = keep[:, -1].logical_not() | (top_k[todo] > 0) | (mass >= top_p[todo]) | (kc == vocab)
            picked = ids.gather(1, _inverse_cdf(w, u[trunc][todo])[:, None])[:, 0]
            if bool(done.all()):
                out[todo] = picked
                break
            ok = done.nonzero()[:, 0]
            out[torch.tensor(todo, device=dev)[ok]] = picked[ok]
            todo = [todo[j] for j in (~done).nonzero()[:, 0].tolist()]
        if len(trunc) == n:
            return out
        tokens[trunc] = out
        return tokens

    def _draw_full(self, logits: torch.Tensor, min_p: list[float], u: torch.Tensor) -> torch.Tensor:
        """Rows without top_k / top_p: the whole vocabulary in token order, min_p applied."""
        # softmax runs max, exp and sum row by row while the row is in cache: two passes over the
        # batch's logits in memory instead of the four of (logits - max).exp_().
        w = torch.softmax(logits, dim=-1)
        if any(m > 0 for m in min_p):
            threshold = torch.tensor(min_p, device=logits.device)[:, None] * w.amax(dim=-1, keepdim=True)
            w.masked_fill_(w < threshold, 0.0)
        return _inverse_cdf(w, u)


_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment: 2^64 / the golden ratio


def _mix64(z: int) -> int:
    """SplitMix64's finalizer (Steele, Lea and Flood, 2014): a bijection of 64-bit words that spreads every input bit
    over every output bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that draws output token ``position`` (0: the first) of a request with ``seed``: the
    ``position``-th value of a SplitMix64 stream whose start is the mixed seed, its top 53 bits as a double.

    A function of (seed, position) and nothing else, so a seeded request draws the same tokens whichever engine
    computes them, after a preemption or a migration alike; computing it costs about a microsecond of Python,
    less than a draw from a per-request ``torch.Generator`` did (``tests/bench/bench_migration.py --seeded``)."""
    start = _mix64(seed & _MASK64)
    return (_mix64((start + (position + 1) * _GAMMA) & _MASK64) >> 11) * (1.0 / (1 << 53))


# top_p rows look for their nucleus among this many best tokens first, then (if their mass is
# short of top_p) among the next size, then in a full sort of the vocabulary.
_CANDIDATES = (256, 4096, 1 << 62)


def _truncate(vals: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: list[float],
              total: torch.Tensor, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For probabilities ``vals`` sorted best first: (kept mask, weights, candidate mass after
    min_p/top_k as a fraction of the row's). ``total`` is the row's min_p-kept probability, used
    where top_k is off."""
    kc = vals.shape[1]
    keep = torch.ones_like(vals, dtype=torch.bool)
    if any(m > 0 for m in min_p):
        keep &= vals >= torch.tensor(min_p, device=dev)[:, None] * vals[:, :1]
    keep &= torch.arange(kc, device=dev)[None, :] < torch.where(top_k > 0, top_k, kc)[:, None]
    w = vals.masked_fill(~keep, 0.0).double()
    cum = w.cumsum(dim=-1)
    z = torch.where(top_k > 0, cum[:, -1], total)
    # top_p keeps the shortest best-first prefix holding at least top_p of the mass: token j
    # stays while the mass before it is below top_p (the best token always stays).
    keep &= (cum - w) < top_p[:, None] * z[:, None]
    return keep, w.masked_fill(~keep, 0.0), cum[:, -1] / z


_BLOCK = 256  # columns per block of the two-level cumulative sum


def _inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Column of each row whose cumulative weight first exceeds ``u`` x the row's total weight.

    A float32 running sum over 49,152 columns drifts by up to ~1e-3 of the total, and a float64
    cumsum of a whole vocabulary costs ~11 ms for 32 rows here, a tenth of a decode step. So wide
    rows go in two levels: the 256-column block sums (float32 within a block, where the error is
    ~1e-6 of the block, then a float64 running sum over the blocks) pick the block, and only that
    block is summed column by column.
    """
    n, cols = w.shape
    if cols <= 2 * _BLOCK:
        cum = w.cumsum(dim=-1, dtype=torch.float64)
        x = (u * cum[:, -1])[:, None]  # < the total, since u < 1
        return torch.searchsorted(cum, x, right=True)[:, 0].clamp_(max=cols - 1)
    nb = -(-cols // _BLOCK)
    if nb * _BLOCK != cols:
        w = torch.nn.functional.pad(w, (0, nb * _BLOCK - cols))  # zero weight: never drawn
    blocks = w.view(n, nb, _BLOCK)
    block_mass = blocks.sum(dim=-1).double()  # 256 terms: float32 is exact to ~1e-6 of a block
    cum_blocks = block_mass.cumsum(dim=-1)
    x = (u * cum_blocks[:, -1])[:, None]
    # The first block whose running mass exceeds x: it has positive mass, and x falls inside it.
    b = torch.searchsorted(cum_blocks, x, right=True).clamp_(max=nb - 1)
    before = cum_blocks.gather(1, b) - block_mass.gather(1, b)
    inner = blocks.gather(1, b[:, :, None].expand(n, 1, _BLOCK))[:, 0].double()
    cum = inner.cumsum(dim=-1) + before
    # Rounding between the two levels must not move x out of the block: below it would pick a
    # zero-weight column at its start, past it would run off its end.
    x = torch.maximum(x, before)
    j = torch.searchsorted(cum, x, right=True)
    last = _BLOCK - 1 - (inner > 0).flip(-1).to(torch.uint8).argmax(dim=-1, keepdim=True)
    return (b * _BLOCK + torch.minimum(j, last))[:, 0]
