"""The sampler on random logits: greedy, seeded reproducibility, truncation, penalties, logprobs."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import pytest
import torch

from engine_worker.sampler import Sampler, seeded_uniform
from protocol.messages import SamplingParams

CPU = torch.device("cpu")
EOS = 2
V = 16  # small enough that logprobs=V returns the whole distribution


@dataclass
class Row:
    sampling: SamplingParams
    prompt_ids: list[int] = field(default_factory=list)
    past_output_ids: list[int] = field(default_factory=list)
    grammar: object | None = None


def make_sampler(vocab: int = V) -> Sampler:
    return Sampler(vocab, [EOS], CPU, seed=1234)


def random_logits(rows: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def full_logprobs(sampler: Sampler, logits: torch.Tensor, row: Row) -> torch.Tensor:
    """The processed distribution of one row (``logits`` is [V]), via logprobs=V, in token order."""
    assert row.sampling.logprobs == logits.shape[0]
    out = sampler.sample(logits.clone()[None], [row])[0]
    lp = torch.full((logits.shape[0],), float("nan"))
    lp[torch.tensor(out.top_ids)] = torch.tensor(out.top_logprobs)
    return lp


def test_greedy_rows_take_the_argmax():
    logits = random_logits(6, 1000)
    rows = [Row(SamplingParams(temperature=0.0)) for _ in range(6)]
    outs = make_sampler(1000).sample(logits.clone(), rows)
    assert [o.token_id for o in outs] == logits.argmax(-1).tolist()
    assert all(o.logprob is None and o.top_ids is None for o in outs)


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = random_logits(8, 1000, seed=1)
    s = make_sampler(1000)
    for params in (SamplingParams(temperature=1.3, top_k=1), SamplingParams(temperature=1.3, top_p=1e-6)):
        outs = s.sample(logits.clone(), [Row(params) for _ in range(8)])
        assert [o.token_id for o in outs] == logits.argmax(-1).tolist(), params


def _seeded_run(sampler: Sampler, logits_steps: list[torch.Tensor], target: int, mates: list[Row]) -> list[int]:
    """Sample the seeded row ``target`` over several steps with ``mates`` around it."""
    row = Row(SamplingParams(temperature=1.0, seed=42))
    got = []
    for logits in logits_steps:
        rows = list(mates)
        rows.insert(target, row)
        got.append(sampler.sample(logits.clone(), rows)[target].token_id)
        row.past_output_ids.append(got[-1])
    return got


def test_seeded_rows_repeat_regardless_of_batch_mates():
    vocab = 5000
    steps = [random_logits(1, vocab, seed=10 + i)[0] * 0.3 for i in range(6)]  # flat-ish: draws matter
    alone = _seeded_run(make_sampler(vocab), [s[None] for s in steps], 0, [])

    s = make_sampler(vocab)
    mates = [
        Row(SamplingParams(temperature=1.0)),  # unseeded: shared generator
        Row(SamplingParams(temperature=0.7, seed=7)),
        Row(SamplingParams(temperature=0.0)),
        Row(SamplingParams(temperature=1.0, top_p=0.9)),
    ]
    batched_steps = [torch.cat([random_logits(2, vocab, seed=99 + i), st[None], random_logits(2, vocab, seed=50 + i)])
                     for i, st in enumerate(steps)]
    batched = _seeded_run(s, batched_steps, 2, mates)
    assert batched == alone
    # The draws really are random: another seed gives another sequence.
    other = make_sampler(vocab)
    row = Row(SamplingParams(temperature=1.0, seed=43))
    assert [other.sample(st[None].clone(), [row])[0].token_id for st in steps] != alone


def test_a_seeded_request_resumed_elsewhere_draws_what_it_would_have_drawn():
    """A migration: the first tokens come from one engine, the rest from another (a fresh sampler whose shared
    generator is elsewhere, other batch mates), given only the tokens generated so far."""
    vocab = 5000
    steps = [random_logits(1, vocab, seed=60 + i)[0] * 0.3 for i in range(8)]
    whole = _seeded_run(make_sampler(vocab), [st[None] for st in steps], 0, [])
    other = Sampler(vocab, [EOS], CPU, seed=999)
    other.sample(random_logits(4, vocab), [Row(SamplingParams()) for _ in range(4)])  # its shared stream moved on
    row = Row(SamplingParams(temperature=1.0, seed=42), past_output_ids=whole[:5])
    rest = []
    for st in steps[5:]:
        rows = [Row(SamplingParams(temperature=0.9)), row]
        rest.append(other.sample(torch.cat([random_logits(1, vocab, seed=3), st[None]]), rows)[1].token_id)
        row.past_output_ids.append(rest[-1])
    assert rest == whole[5:]


def test_seeded_uniforms_are_uniform_and_differ_by_seed_and_position():
    draws = [seeded_uniform(7, i) for i in range(20000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.01
    # Kolmogorov-Smirnov distance from the uniform distribution (critical value at 1%: 1.63 / sqrt(n) = 0.0115).
    ordered = sorted(draws)
    assert max(max((i + 1) / len(ordered) - u, u - i / len(ordered)) for i, u in enumerate(ordered)) < 0.0115
    assert len(set(draws)) == len(draws)
    assert [seeded_uniform(8, i) for i in range(100)] != draws[:100]
    assert seeded_uniform(-1, 0) == seeded_uniform((1 << 64) - 1, 0)  # seeds are taken modulo 2^64 (OpenAI's range)
    assert seeded_uniform(7, 5) == draws[5]  # a function of (seed, position) alone


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    n = 4000
    logits = probs.log().repeat(n, 1)
    outs = Sampler(4, [EOS], CPU, seed=3).sample(logits, [Row(SamplingParams()) for _ in range(n)])
    freq = torch.bincount(torch.tensor([o.token_id for o in outs]), minlength=4).float() / n
    # 4 standard errors of a binomial proportion at p=0.5, n=4000 is ~0.032.
    assert torch.allclose(freq, probs, atol=0.035), freq


def test_top_k_and_min_p_restrict_the_candidates():
    logits = random_logits(1, 50, seed=5)[0]
    top2 = set(logits.topk(2).indices.tolist())
    s = make_sampler(50)
    n = 300
    outs = s.sample(logits.repeat(n, 1), [Row(SamplingParams(temperature=5.0, top_k=2)) for _ in range(n)])
    assert {o.token_id for o in outs} == top2  # both survive at a high temperature, nothing else

    probs = (logits / 5.0).softmax(-1)
    allowed = set((probs >= 0.5 * probs.max()).nonzero()[:, 0].tolist())
    outs = s.sample(logits.repeat(n, 1), [Row(SamplingParams(temperature=5.0, min_p=0.5)) for _ in range(n)])
    assert {o.token_id for o in outs} <= allowed


def test_logit_bias_shifts_the_chosen_token():
    logits = random_logits(1, V, seed=2)
    worst = int(logits[0].argmin())
    s = make_sampler()
    out = s.sample(logits.clone(), [Row(SamplingParams(temperature=0.0, logit_bias=((worst, 100.0),)))])[0]
    assert out.token_id == worst
    best = int(logits[0].argmax())
    out = s.sample(logits.clone(), [Row(SamplingParams(temperature=0.0, logit_bias=((best, -100.0),)))])[0]
    assert out.token_id != best

    base = full_logprobs(s, logits[0], Row(SamplingParams(temperature=0.0, logprobs=V)))
    biased = full_logprobs(s, logits[0], Row(SamplingParams(temperature=0.0, logprobs=V, logit_bias=((3, 1.5),))))
    # Log-prob differences are logit differences: token 3 gains exactly 1.5 over every other token.
    assert (biased[3] - biased[0]) - (base[3] - base[0]) == pytest.approx(1.5, abs=1e-4)


def test_presence_and_frequency_penalties_lower_output_tokens():
    logits = random_logits(1, V, seed=3)[0]
    s = make_sampler()
    past = [5, 5, 5, 7]  # token 5 three times, token 7 once; token 9 never
    base = full_logprobs(s, logits, Row(SamplingParams(temperature=0.0, logprobs=V), past_output_ids=past))
    pres = full_logprobs(s, logits, Row(SamplingParams(temperature=0.0, logprobs=V, presence_penalty=0.5),
                                        past_output_ids=past))
    freq = full_logprobs(s, logits, Row(SamplingParams(temperature=0.0, logprobs=V, frequency_penalty=0.5),
                                        past_output_ids=past))
    rel = lambda lp, t: float(lp[t] - lp[9])  # noqa: E731 - logit of t relative to an unseen token
    assert rel(pres, 5) == pytest.approx(rel(base, 5) - 0.5, abs=1e-4)
    assert rel(pres, 7) == pytest.approx(rel(base, 7) - 0.5, abs=1e-4)
    assert rel(freq, 5) == pytest.approx(rel(base, 5) - 1.5, abs=1e-4)
    assert rel(freq, 7) == pytest.approx(rel(base, 7) - 0.5, abs=1e-4)
    # Prompt tokens are not penalised by presence/frequency.
    prompt_only = full_logprobs(s, logits, Row(SamplingParams(temperature=0.0, logprobs=V, presence_penalty=2.0),
                                                prompt_ids=[5, 7]))
    assert rel(prompt_only, 5) == pytest.approx(rel(base, 5), abs=1e-4)


def test_repetition_penalty_pushes_seen_tokens_toward_unlikely():
    logits = torch.zeros(V)
    logits[4], logits[6], logits[9] = 2.0, -1.0, 0.5
    s = make_sampler()
    row = Row(SamplingParams(temperature=0.0, logprobs=V, repetition_penalty=2.0), prompt_ids=[4], past_output_ids=[6])
    lp = full_logprobs(s, logits, row)
    ref = logits.clone()
    ref[4], ref[6] = 1.0, -2.0  # positive divided, negative multiplied; 9 unseen, untouched
    assert torch.allclose(lp, torch.log_softmax(ref, -1), atol=1e-5)


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(1, V)
    logits[0, EOS], logits[0, 11], logits[0, 8] = 10.0, 9.0, 8.0
    s = make_sampler()
    params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=10, stop_token_ids=(11,))
    assert s.sample(logits.clone(), [Row(params, past_output_ids=[1])])[0].token_id == 8
    assert s.sample(logits.clone(), [Row(params, past_output_ids=[1, 1, 1])])[0].token_id == EOS
    # Sampled rows too: with EOS and 11 masked, their probability is exactly zero.
    hot = SamplingParams(temperature=1.0, min_tokens=3, max_tokens=10, stop_token_ids=(11,), logprobs=2)
    outs = s.sample(logits.repeat(50, 1), [Row(hot, past_output_ids=[1]) for _ in range(50)])
    assert all(o.token_id not in (EOS, 11) for o in outs)
    assert outs[0].top_ids[0] == 8


def test_logprobs_are_log_probabilities_of_the_processed_distribution():
    logits = random_logits(3, 200, seed=4)
    s = make_sampler(200)
    temps = [0.0, 1.0, 0.5]
    rows = [Row(SamplingParams(temperature=t, logprobs=5)) for t in temps]
    outs = s.sample(logits.clone(), rows)
    for i, (o, t) in enumerate(zip(outs, temps)):
        ref = torch.log_softmax(logits[i] / (t or 1.0), -1)
        assert o.logprob == pytest.approx(float(ref[o.token_id]), abs=1e-5)
        assert o.top_ids == ref.topk(5).indices.tolist()
        assert o.top_logprobs == pytest.approx(ref.topk(5).values.tolist(), abs=1e-5)
        assert o.top_logprobs == sorted(o.top_logprobs, reverse=True)
        assert sum(math.exp(v) for v in o.top_logprobs) <= 1.0 + 1e-6
        assert o.logprob <= 0.0
    # logprobs=0: the sampled token's logprob only.
    out = s.sample(logits[:1].clone(), [Row(SamplingParams(temperature=0.0, logprobs=0))])[0]
    assert out.logprob is not None and out.top_ids == [] and out.top_logprobs == []


def test_each_row_of_a_mixed_batch_gets_only_its_own_processing():
    """Penalties, bias and temperature are applied per row in one vectorised pass: a row's
    distribution is the same alone and beside rows with other settings."""
    logits = random_logits(4, V, seed=8)
    s = make_sampler()
    rows = [
        Row(SamplingParams(temperature=0.0, logprobs=V, repetition_penalty=1.5), prompt_ids=[1, 2],
            past_output_ids=[3]),
        Row(SamplingParams(temperature=0.7, logprobs=V, frequency_penalty=1.0), past_output_ids=[4, 4]),
        Row(SamplingParams(temperature=0.0, logprobs=V, logit_bias=((6, -3.0),))),
        # negative: favour
        Row(SamplingParams(temperature=1.0, logprobs=V, presence_penalty=-1.0), past_output_ids=[9]),
    ]
    batched = s.sample(logits.clone(), rows)
    for i, row in enumerate(rows):
        alone = s.sample(logits[i : i + 1].clone(), [row])[0]
        assert alone.top_ids == batched[i].top_ids
        assert alone.top_logprobs == pytest.approx(batched[i].top_logprobs, abs=1e-5)
    lp = {t: v for t, v in zip(batched[3].top_ids, batched[3].top_logprobs)}
    ref = torch.log_softmax(logits[3], -1)
    assert lp[9] - float(ref[9]) > 0.5  # a negative presence penalty raises the seen token


def test_prompt_logprobs_score_each_prompt_token_under_the_raw_distribution():
    logits = random_logits(3, V, seed=6)
    out = make_sampler().prompt_logprobs(logits.clone(), [4, 0, 11], k=3)
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs == pytest.approx([float(ref[0, 4]), float(ref[1, 0]), float(ref[2, 11])], abs=1e-6)
    assert out.top_ids == ref.topk(3).indices.tolist()
    # Each token's rank: how many tokens are at least as likely (itself included), as vLLM counts it.
    assert out.ranks == [int((ref[i] >= ref[i, t]).sum()) for i, t in enumerate([4, 0, 11])]
    top1 = ref[0].argmax().item()
    assert make_sampler().prompt_logprobs(logits.clone(), [top1, 2, 3], k=0).ranks[0] == 1
    assert make_sampler().prompt_logprobs(logits, [1, 2, 3], k=0).top_ids == [[], [], []]


def test_plain_greedy_rows_take_the_argmax_of_the_raw_logits_and_modifiers_still_apply():
    """An all-plain-greedy batch (bf16 logits here) takes the short path; one row with a bias (or
    penalties, min_tokens, logprobs) sends the whole batch through the full one."""
    logits = random_logits(4, 64, seed=9).bfloat16()
    s = make_sampler(64)
    plain = [Row(SamplingParams(temperature=0.0)) for _ in range(4)]
    assert [o.token_id for o in s.sample(logits.clone(), plain)] == logits.float().argmax(-1).tolist()
    biased = Row(SamplingParams(temperature=0.0, logit_bias=((5, 100.0),)))
    outs = s.sample(logits.clone(), plain[:3] + [biased])
    assert outs[3].token_id == 5 and [o.token_id for o in outs[:3]] == logits[:3].float().argmax(-1).tolist()
    with_logprobs = Row(SamplingParams(temperature=0.0, logprobs=1))
    assert s.sample(logits[:1].clone(), [with_logprobs])[0].logprob is not None


# -- the inverse-CDF draw against a straightforward reference ------------------------------------


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The intended distribution of one row ([V]): temperature, min_p, top_k, then top_p as the
    shortest best-first prefix of the sorted probabilities holding at least top_p of the mass."""
    x = logits.double() / (p.temperature or 1.0)
    probs = x.softmax(-1)
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
    srt, order = probs.sort(descending=True)
    if 0 < p.top_k < len(srt):
        srt[p.top_k :] = 0.0
    srt = srt / srt.sum()
    if p.top_p < 1.0:
        before = srt.cumsum(-1) - srt  # mass strictly before each token, best first
        srt = torch.where(before < p.top_p, srt, 0.0)
    out = torch.zeros_like(probs)
    out[order] = srt / srt.sum()
    return out


METHODS = {
    "temperature": SamplingParams(temperature=0.8),
    "top_k": SamplingParams(temperature=1.2, top_k=5),
    "top_p": SamplingParams(temperature=1.0, top_p=0.8),
    "min_p": SamplingParams(temperature=1.0, min_p=0.1),
    "combined": SamplingParams(temperature=0.9, top_k=9, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("method", list(METHODS))
def test_draws_follow_the_intended_distribution(method):
    vocab, n = 12, 20000
    logits = random_logits(1, vocab, seed=21)[0] * 0.6
    params = METHODS[method]
    want = reference_probs(logits, params)
    outs = Sampler(vocab, [EOS], CPU, seed=5).sample(logits.repeat(n, 1), [Row(params) for _ in range(n)])
    counts = torch.bincount(torch.tensor([o.token_id for o in outs]), minlength=vocab).double()
    assert counts[want == 0].sum() == 0, "a truncated token was drawn"
    kept = want > 0
    expected = want[kept] * n
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    # dof <= 11: the 1e-6 upper quantile is ~45; 60 is generous, yet a wrong distribution gives hundreds.
    assert chi2 < 60.0, (method, chi2, counts.tolist(), expected.tolist())


@pytest.mark.parametrize("method", list(METHODS))
def test_seeded_rows_repeat_alone_and_in_a_mixed_batch(method):
    vocab = 6000
    steps = [random_logits(1, vocab, seed=30 + i)[0] for i in range(5)]
    params = dataclasses.replace(METHODS[method], seed=11)

    def alone_of(sampler, st, row):
        return st[None].clone(), [row], 0

    def mixed_of(sampler, st, row):
        mates = [Row(SamplingParams(temperature=1.0, top_k=5000)), Row(SamplingParams(temperature=0.0)),
                 Row(SamplingParams(temperature=0.5, top_p=0.95, seed=3)),
                 Row(SamplingParams(temperature=1.0, min_p=0.2))]
        rows = mates[:1] + [row] + mates[1:]
        return torch.cat([random_logits(1, vocab, seed=7), st[None], random_logits(3, vocab, seed=8) * 0.2]), rows, 1

    def run(sampler: Sampler, batch_of) -> list[int]:
        row = Row(params)
        got = []
        for st in steps:
            logits, rows, at = batch_of(sampler, st, row)
            got.append(sampler.sample(logits, rows)[at].token_id)
            row.past_output_ids.append(got[-1])
        return got

    alone = run(make_sampler(vocab), alone_of)
    assert run(make_sampler(vocab), mixed_of) == alone
    assert run(make_sampler(vocab), alone_of) == alone


KEEP_CASES = [
    (50, 3.0, SamplingParams(temperature=1.0, top_p=0.7)),
    (50, 3.0, SamplingParams(temperature=1.0, top_k=7)),
    (50, 3.0, SamplingParams(temperature=2.0, min_p=0.3)),
    (50, 3.0, SamplingParams(temperature=1.5, top_k=20, top_p=0.6, min_p=0.02)),
    (6000, 2.0, SamplingParams(temperature=1.0, top_p=0.95)),  # nucleus beyond the first 256 candidates
    (6000, 0.3, SamplingParams(temperature=1.0, top_p=0.9)),  # nearly flat: beyond 4096, a full sort
    (6000, 0.3, SamplingParams(temperature=1.0, top_k=300, top_p=0.5)),  # top_k above the first size
]


@pytest.mark.parametrize("vocab,scale,params", KEEP_CASES)
def test_truncation_keeps_exactly_the_reference_candidates(monkeypatch, vocab, scale, params):
    """With u pinned near 0 and near 1, the draw returns the first and the last kept token (best
    first for top_k / top_p, token order for min_p alone); every draw is in the reference set."""
    logits = random_logits(1, vocab, seed=13)[0] * scale / 3
    want = reference_probs(logits, params)
    kept = set(want.nonzero()[:, 0].tolist())
    grid = torch.tensor([0.0, 1.0 - 1e-12] + [(j + 0.5) / 200 for j in range(200)], dtype=torch.float64)
    monkeypatch.setattr(Sampler, "_uniforms", lambda self, rows, dev: grid.clone())
    outs = [o.token_id for o in make_sampler(vocab).sample(logits.repeat(len(grid), 1),
                                                          [Row(params) for _ in grid])]
    assert set(outs) <= kept
    if params.top_k or params.top_p < 1.0:
        ranked = sorted(kept, key=lambda t: -float(logits[t]))
        assert (outs[0], outs[1]) == (ranked[0], ranked[-1])
    else:
        assert (outs[0], outs[1]) == (min(kept), max(kept))
    # In a batch beside other settings, the same pinned draws give the same tokens.
    mate = Row(SamplingParams(temperature=1.0, top_k=vocab - 1))
    rows = [Row(params) for _ in grid] + [mate]
    monkeypatch.setattr(Sampler, "_uniforms", lambda self, rows, dev: torch.cat([grid, grid[:1]]))
    mixed = make_sampler(vocab).sample(torch.cat([logits.repeat(len(grid), 1), logits[None]]), rows)
    assert [o.token_id for o in mixed[:-1]] == outs


def test_two_level_inverse_cdf_picks_what_one_cumulative_sum_picks() -> None:
    # Wide rows (here 3000 columns: 12 blocks, the last one padded) are drawn block first, then
    # inside the block; the column must be the one a plain float64 cumulative sum gives, and never
    # a zero-weight column, for uniforms spread over [0, 1) including both edges.
    from engine_worker.sampler import _inverse_cdf

    g = torch.Generator().manual_seed(5)
    w = torch.rand(6, 3000, generator=g) ** 8
    w[w < 0.05] = 0.0  # many zero-weight columns, whole zero blocks included
    w[1, :2000] = 0.0
    w[2] = 0.0
    w[2, 2999] = 1.0  # all the mass in the padded last block
    edges = torch.tensor([0.0, 1e-12, 1 - 1e-12], dtype=torch.float64)  # uniforms are in [0, 1)
    u = torch.cat([edges, torch.rand(197, generator=g, dtype=torch.float64)])
    for ui in u:
        rows_u = ui.expand(6).clone()
        got = _inverse_cdf(w, rows_u)
        cum = w.cumsum(dim=-1, dtype=torch.float64)
        want = torch.searchsorted(cum, (rows_u * cum[:, -1])[:, None], right=True)[:, 0].clamp(max=2999)
        assert bool((w.gather(1, got[:, None]) > 0).all()), (float(ui), got)
        assert got.tolist() == want.tolist(), float(ui)
