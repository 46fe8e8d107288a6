"""Turn one step's logits into tokens for a mixed batch of requests, vectorised over rows.

Order of operations (as vLLM's V1 sampler does):

1. ``logit_bias`` and the ``min_tokens`` mask (EOS and ``stop_token_ids`` get -inf until the
   request has produced ``min_tokens`` tokens);
2. penalties: repetition over prompt + output tokens (divide positive logits, multiply negative
   ones), then frequency (x count) and presence (x seen) over output tokens only;
3. greedy rows (temperature 0, or top_k 1) take the argmax here;
4. temperature, then min_p, top_k and top_p truncation;
5. a draw by exponential race: ``argmax(probs / q)`` with ``q ~ Exp(1)`` per vocabulary entry,
   which picks token i with probability probs[i]. A seeded request draws ``q`` from its own
   ``torch.Generator``, so its tokens do not depend on its batch mates; unseeded rows share one.

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

from protocol.messages import SamplingParams


class SamplingRow(Protocol):
    """What the sampler reads of a sequence (``runner.SeqInput`` has these fields)."""

    sampling: SamplingParams
    prompt_ids: list[int]
    past_output_ids: list[int]
    generator: torch.Generator | None


@dataclass
class PromptLogprobs:
    """Logprobs of consecutive prompt tokens (each given the tokens before it)."""

    logprobs: list[float]
    top_ids: list[list[int]]  # per token, the k most likely ids, best first
    top_logprobs: list[list[float]]


@dataclass
class SampleOut:
    token_id: int | None  # None when only prompt logprobs were computed (a non-final chunk)
    logprob: float | None  # None unless the request asked for logprobs
    top_ids: list[int] | None  # the ``logprobs`` most likely ids, best first
    top_logprobs: list[float] | None
    prompt: PromptLogprobs | None = None


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
    return (p.greedy and not p.logit_bias and p.logprobs is None and p.repetition_penalty == 1.0
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

    def make_generator(self, seed: int) -> torch.Generator:
        """A fresh generator for a seeded request: the same seed always gives the same draws."""
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return g

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampleOut]:
        """One token per row of ``logits`` ([B, V]); ``logits`` may be modified in place."""
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

        self._apply_bias_and_min_tokens(logits, rows, vocab)
        self._apply_penalties(logits, rows, vocab)

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
        if s_idx:
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
        chosen = lp.gather(1, torch.tensor(list(targets), device=lp.device)[:, None])[:, 0].tolist()
        if k:
            top_v, top_i = lp.topk(k, dim=-1)
            return PromptLogprobs(chosen, top_i.tolist(), top_v.tolist())
        return PromptLogprobs(chosen, [[] for _ in chosen], [[] for _ in chosen])

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

    def _draw(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Sample one token per row of (temperature-scaled) ``logits`` after min_p/top-k/top-p."""
        n, vocab = logits.shape
        params = [r.sampling for r in rows]
        dev = logits.device
        neg_inf = float("-inf")
        if any(p.min_p > 0 for p in params):
            probs = logits.softmax(dim=-1)
            min_p = torch.tensor([p.min_p for p in params], device=dev)[:, None]
            logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, neg_inf)
        ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        if any(ks):
            kmax = max(ks)
            top = logits.topk(kmax, dim=-1).values
            kth = top.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=dev)[:, None])
            kth[torch.tensor([k == 0 for k in ks], device=dev)] = neg_inf  # rows without top-k keep all
            logits = logits.masked_fill(logits < kth, neg_inf)
        if any(p.top_p < 1.0 for p in params):
            srt, order = logits.sort(dim=-1)  # ascending
            cum = srt.softmax(dim=-1).cumsum(dim=-1)
            drop = cum <= 1.0 - torch.tensor([p.top_p for p in params], device=dev)[:, None]
            drop[:, -1] = False  # always keep the most likely token
            logits = torch.empty_like(logits).scatter_(1, order, srt.masked_fill(drop, neg_inf))
        probs = logits.softmax(dim=-1)

        q = torch.empty_like(probs)
        shared = [i for i, r in enumerate(rows) if r.generator is None]
        if shared:
            q[shared] = torch.empty((len(shared), vocab), device=dev).exponential_(generator=self._shared)
        for i, r in enumerate(rows):
            if r.generator is not None:
                q[i].exponential_(generator=r.generator)
        return (probs / q).argmax(dim=-1)
