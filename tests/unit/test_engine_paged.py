"""The paged engine's moving parts: block manager accounting and prefix hashing, and — on the
tiny random model — n > 1 prefix sharing, seeded sampling inside busy batches, preemption
with sampling, prompt logprobs across chunks, and the engine's stats counters."""

from __future__ import annotations

import os

import pytest
import torch

from engine_worker.block_manager import BlockManager, block_hashes
from engine_worker.kv_cache import PagedKVCache
from engine_worker.loader import load_model
from engine_worker.runner import ModelRunner
from engine_worker.scheduler import Scheduler, run_until_done
from engine_worker.sequence import Sequence
from protocol.kv_events import block_hash
from protocol.messages import SamplingParams
from zserve.catalog import resolve

CPU = torch.device("cpu")
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182]


# -- block manager --------------------------------------------------------------------------

def test_blocks_are_counted_and_shared_blocks_freed_once_unreferenced():
    bm = BlockManager(4, 2)
    a = bm.allocate(2)
    assert a == [0, 1] and bm.num_free == 2 and bm.num_used == 2
    bm.take([a[0]])  # a second request shares block 0
    bm.free(a)
    assert bm.num_used == 1 and bm.ref_count[0] == 1
    bm.free([a[0]])
    assert bm.num_used == 0
    with pytest.raises(ValueError):
        bm.free([a[0]])
    with pytest.raises(RuntimeError):
        bm.allocate(5)


def test_full_blocks_are_found_by_chained_content_hash():
    bm = BlockManager(8, 2)
    toks = [5, 6, 7, 8, 9]
    table = bm.allocate(3)
    parent = None
    for i in range(2):  # two full blocks
        parent = bm.register(table[i], parent, tuple(toks[2 * i : 2 * i + 2]))
    assert block_hashes(toks, 2) == [block_hash(None, (5, 6)), parent]  # (stable: a gateway computes the same)
    assert bm.lookup(toks, 4) == table[:2]
    assert bm.lookup(toks, 3) == table[:1]  # at most 3 tokens: whole blocks only
    assert bm.lookup([5, 6, 0, 8, 9], 4) == table[:1]  # the chain breaks at the first difference
    assert bm.lookup([7, 8], 2) == []  # same block content, different prefix: no hit
    assert BlockManager(8, 2, enable_prefix_caching=False).lookup(toks, 4) == []


def test_unreferenced_cached_blocks_are_evicted_least_recently_used_and_last():
    bm = BlockManager(4, 1)
    first, second = bm.allocate(1), bm.allocate(1)
    h1 = bm.register(first[0], None, (1,))
    bm.register(second[0], None, (2,))
    bm.free(first)
    bm.free(second)
    assert bm.num_cached == 2 and bm.num_free == 4
    # Blocks holding nothing are handed out before any cached block...
    fresh = bm.allocate(2)
    assert set(fresh).isdisjoint(first + second) and bm.num_cached == 2
    # ...then the least recently freed cached block goes first.
    assert bm.allocate(1) == first and bm.num_cached == 1
    assert bm.lookup([1], 1) == [] and bm.lookup([2], 1) == second
    assert h1 == block_hash(None, (1,))


def test_a_cache_hit_takes_the_block_out_of_the_free_queue():
    bm = BlockManager(2, 1)
    b = bm.allocate(1)
    bm.register(b[0], None, (3,))
    bm.free(b)
    hit = bm.lookup([3, 4], 1)
    assert hit == b and bm.can_allocate(1, hit) and not bm.can_allocate(2, hit)
    bm.take(hit)
    assert bm.num_free == 1 and bm.allocate(1) != b


# -- the engine on the tiny random model ------------------------------------------------------

@pytest.fixture(scope="module")
def loaded():
    return load_model(resolve("tiny-random"), torch.float32, CPU)


def make_runner(loaded, num_blocks: int = 64, block_size: int = 4, **kw) -> ModelRunner:
    return ModelRunner(loaded, CPU, torch.float32, max_num_seqs=8, max_model_len=64, num_blocks=num_blocks,
                       block_size=block_size, **kw)


def run(runner, requests: list[tuple[list[int], SamplingParams]], budget: int = 256, stagger: bool = False,
        sched: Scheduler | None = None):
    """Run ``requests`` to the end through ``sched`` (default: a fresh scheduler, so an empty prefix cache)."""
    sched = sched or Scheduler(runner, 8, budget)
    pending = list(enumerate(requests))

    def feed(s):
        while pending:
            i, (p, sp) = pending.pop(0)
            assert s.add(Sequence(f"r{i}", list(p), sp)) is None
            if stagger:
                return

    outs = run_until_done(sched, feed)
    return [outs[f"r{i}"] for i in range(len(requests))], sched


def toks(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def hot(seed: int | None, n: int = 10) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=n, ignore_eos=True)


def test_n_copies_of_a_prompt_share_its_blocks_and_give_n_completions(loaded):
    runner = make_runner(loaded)
    outs, sched = run(runner, [(PROMPT, hot(s)) for s in (1, 2, 3)])
    completions = [toks(o) for o in outs]
    assert all(len(c) == 10 for c in completions) and len({tuple(c) for c in completions}) == 3
    # The 19-token prompt has 4 full blocks of 4: computed once, then shared by the copies.
    assert sched.prompt_tokens == 19 + 2 * 3
    assert [o[0].num_cached_tokens for o in outs] == [0, 16, 16]
    # Each copy alone (fresh engine) samples the very same tokens: sharing changes nothing.
    for s, c in zip((1, 2, 3), completions):
        alone, _ = run(make_runner(loaded), [(PROMPT, hot(s))])
        assert toks(alone[0]) == c


def test_seeded_request_gives_the_same_tokens_alone_and_in_a_busy_batch(loaded):
    alone, _ = run(make_runner(loaded), [(PROMPT, hot(42, 12))])
    busy = [
        (PROMPT[:7], hot(None, 12)),
        (PROMPT[3:], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)),
        (PROMPT, hot(42, 12)),  # the request under test, same prompt as another seeded one below
        (PROMPT, hot(7, 12)),
        (PROMPT[::-1], SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3, max_tokens=12, ignore_eos=True)),
    ]
    # Staggered arrivals, chunked prefill and a pool small enough to preempt.
    outs, sched = run(make_runner(loaded, num_blocks=20), busy, budget=6, stagger=True)
    assert sched.preemptions > 0
    assert toks(outs[2]) == toks(alone[0])


def test_preemption_with_sampling_changes_no_output(loaded):
    reqs = [(PROMPT[i:] + PROMPT[:i], hot(100 + i, 16)) for i in range(5)]
    roomy, s1 = run(make_runner(loaded, num_blocks=128), reqs)
    tight, s2 = run(make_runner(loaded, num_blocks=17), reqs)
    assert s1.preemptions == 0 and s2.preemptions >= 2
    assert [toks(o) for o in tight] == [toks(o) for o in roomy]
    penalised = [(p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3,
                                    frequency_penalty=0.5, presence_penalty=0.2)) for p, _ in reqs]
    assert [toks(o) for o in run(make_runner(loaded, num_blocks=17), penalised)[0]] == \
        [toks(o) for o in run(make_runner(loaded, num_blocks=128), penalised)[0]]


def test_prompt_logprobs_arrive_once_with_the_first_token_whatever_the_chunking(loaded):
    sp = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=4, ignore_eos=True)
    whole, _ = run(make_runner(loaded), [(PROMPT, sp)])
    chunked, _ = run(make_runner(loaded), [(PROMPT, sp)], budget=5)
    first = whole[0][0]
    assert len(first.prompt_logprobs) == len(PROMPT) - 1
    assert first.prompt_top_logprobs.k == 4 and len(first.prompt_top_logprobs.token_ids) == 4 * (len(PROMPT) - 1)
    assert all(o.prompt_logprobs is None for o in whole[0][1:])
    assert chunked[0][0].prompt_logprobs == pytest.approx(first.prompt_logprobs, abs=1e-5)
    assert chunked[0][0].prompt_top_logprobs.token_ids == first.prompt_top_logprobs.token_ids
    # The same numbers as one plain forward pass over the prompt.
    ref = _full_logprobs(loaded, PROMPT)
    want = [float(ref[i, PROMPT[i + 1]]) for i in range(len(PROMPT) - 1)]
    assert first.prompt_logprobs == pytest.approx(want, abs=1e-5)
    assert chunked[0][0].prompt_ranks == first.prompt_ranks
    top = first.prompt_top_logprobs.token_ids
    for i, rank in enumerate(first.prompt_ranks):  # a token among the top 4 ranks as it is placed there; else lower
        best = top[4 * i : 4 * i + 4]
        assert rank == (best.index(PROMPT[i + 1]) + 1 if PROMPT[i + 1] in best else max(rank, 5))
    # A cached prefix is not used for a request that wants prompt logprobs: they need the logits.
    runner = make_runner(loaded)
    _, sched = run(runner, [(PROMPT, SamplingParams(temperature=0.0, max_tokens=1))])
    again, _ = run(runner, [(PROMPT, sp)], sched=sched)
    assert again[0][0].num_cached_tokens == 0 and again[0][0].prompt_logprobs == pytest.approx(want, abs=1e-5)


def _full_logprobs(loaded, prompt):
    runner = make_runner(loaded)
    bm = BlockManager(runner.num_blocks, runner.block_size)
    from engine_worker.runner import SeqInput

    table = bm.allocate(bm.blocks_needed(len(prompt)))
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    out = runner.execute([SeqInput(table, list(prompt), 0, sp, [], list(prompt), sample=False,
                                   prompt_logprobs_rows=len(prompt) - 1)])[0]
    bm.free(table)
    lp = torch.full((len(prompt) - 1, loaded.vocab_size), float("nan"))
    for i, v in enumerate(out.prompt.logprobs):
        lp[i, prompt[i + 1]] = v
    return lp


def test_engine_counters_for_stats(loaded):
    runner = make_runner(loaded, num_blocks=17)
    reqs = [(PROMPT[i:] + PROMPT[:i], hot(i, 16)) for i in range(5)]
    _, sched = run(runner, reqs)
    assert sched.preemptions > 0 and sched.num_preempted == 0  # all recomputed by the end
    assert sched.generated_tokens == 5 * 16 and sched.steps > 16
    assert sched.prompt_tokens >= 5 * len(PROMPT)  # recomputes count too
    assert sched.tokens_per_step > 1 and sched.block_manager.num_used == 0 and sched.kv_used == 0.0

    runner = make_runner(loaded)
    _, sched = run(runner, [(PROMPT, hot(1, 2)), (PROMPT[:-1] + [5], hot(2, 2))])
    bm = sched.block_manager
    assert bm.hits == 16 and bm.queries == 2 * len(PROMPT) and bm.hit_rate == pytest.approx(16 / 38)
    assert sched.prompt_tokens == 2 * len(PROMPT) - 16


def _reference_decode(cache, layer, q, seqs, window=None):
    """Decode attention written out per row and head in float64, from the block tables."""
    from engine_worker.attention.reference import reference_decode_attention

    return reference_decode_attention(q, cache.kv[layer], [s.block_table for s in seqs],
                                      [s.start_pos + 1 for s in seqs], cache.block_size, window)


DECODE_PATHS = ["torch-gather", "native", "native-portable", "flex"]


@pytest.mark.parametrize("window", [None, 7], ids=["full", "window7"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("path", DECODE_PATHS)
def test_every_decode_attention_path_reads_what_the_block_tables_say(path, head_dim, dtype, window):
    """Each way the engine can run decode attention (torch gather + matmuls, the native CPU kernel
    in its vectorised and portable versions, CUDA's FlexAttention mask run eagerly here) against
    a float64 reference: shared prefix blocks, partial last blocks, rows of very different lengths,
    grouped-query heads, the step's own new key written first, and a sliding window (Mistral)."""
    from engine_worker import cpu_kernels
    from engine_worker.attention import SeqLayout, select_backend
    from engine_worker.attention.flex import flex_decode, flex_decode_mask
    from engine_worker.attention.gather import GatherBackend
    from engine_worker.attention.native import NativeBackend
    from engine_worker.kv_cache import PagedKVCache

    if path.startswith("native") and not cpu_kernels.available():
        pytest.skip("native CPU kernels did not build here (no compiler)")
    if path == "flex":
        if window:
            pytest.skip("windowed models keep the gather path on CUDA")
        flex = pytest.importorskip("torch.nn.attention.flex_attention")
    g = torch.Generator().manual_seed(head_dim)
    kv, heads, bs, nb = 2, 6, 4, 40
    cache = PagedKVCache(2, nb, bs, kv, head_dim, dtype, CPU)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g))
    # The CPU picks the native kernel whenever it built, else the gather path; never flex.
    assert select_backend(cache, heads, window).name == ("native" if cpu_kernels.available() else "gather")
    # Rows 0 and 1 share block 5 (a cached prefix); lengths 1 to 99 keys; the last rows long
    # enough for several 16/32-key chunks of the online softmax.
    seqs = [SeqLayout([5, 2, 9], 9, 1), SeqLayout([5, 7], 5, 1), SeqLayout([0, 1, 3, 4], 13, 1),
            SeqLayout([30], 0, 1), SeqLayout(list(range(10, 35)), 98, 1), SeqLayout([39, 38, 37, 36, 6], 17, 1)]
    backend = (NativeBackend if path.startswith("native") else GatherBackend)(cache, heads, window)
    layout = backend.plan(seqs)
    q = torch.randn(len(seqs), heads, head_dim, generator=g).to(dtype)
    k_new = torch.randn(len(seqs), kv, head_dim, generator=g).to(dtype)
    v_new = torch.randn(len(seqs), kv, head_dim, generator=g).to(dtype)
    backend.write_kv(1, k_new, v_new, layout)  # the new keys first
    if path == "flex":
        mask = flex_decode_mask(nb, bs, seqs, [s.start_pos + 1 for s in seqs], CPU)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = flex_decode(cache.k[1], cache.v[1], q, mask, attention=flex.flex_attention)
    else:
        cpu_kernels.set_portable_only(path == "native-portable")
        try:
            got = backend.attend(1, q, k_new, v_new, layout)
        finally:
            cpu_kernels.set_portable_only(False)
    assert got.dtype == dtype and got.shape == (len(seqs), heads * head_dim)
    want = _reference_decode(cache, 1, q, seqs, window)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16: the output's own rounding, plus q/k/v's
    assert torch.allclose(got.double(), want, atol=tol, rtol=0), (got.double() - want).abs().max()


def test_engine_stats_report_blocks_preemptions_and_prefix_hits(loaded, tmp_path):
    from engine_worker.server import EngineServer
    from protocol import EngineHello, EngineStats, decode, encode

    runner = make_runner(loaded, num_blocks=17)
    sched = Scheduler(runner, 8, 256)
    hello = EngineHello(rank=0, model_id="tiny-random", max_num_seqs=8, max_model_len=64, vocab_size=49152,
                        eos_token_ids=(2,), pid=1, device="cpu", dtype="float32")
    server = EngineServer(0, f"ipc://{tmp_path}/engine.sock", runner, sched, hello)
    try:
        for i in range(5):
            sched.add(Sequence(f"r{i}", PROMPT[i:] + PROMPT[:i], hot(i, 16)))
        for _ in range(8):
            server.step()
        st = server.stats()
        assert st.running + st.waiting == 5 and st.kv_blocks_total == 17
        assert st.kv_blocks_used == sched.block_manager.num_used > 0
        assert st.preemptions == sched.preemptions and st.preempted == sched.num_preempted
        assert st.tokens_per_step > 1 and st.prompt_tokens >= 19
        assert decode(encode(st)) == st and isinstance(st, EngineStats)
    finally:
        server.sock.close()


TRITON_CHECK = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: it fixes the mode at import
import torch
sys.path.insert(0, "tests/unit")
from test_engine_paged import _reference_decode
from engine_worker.attention import SeqLayout, triton
from engine_worker.kv_cache import PagedKVCache

worst = 0.0
for head_dim in (16, 64, 128):
    for window in (None, 7):
        g = torch.Generator().manual_seed(head_dim)
        cache = PagedKVCache(2, 40, 4, 2, head_dim, torch.float32, torch.device("cpu"))
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=g))
        backend = triton.TritonBackend(cache, 6, window)  # plans the int32 tables the kernel reads
        seqs = [SeqLayout([5, 2, 9], 9, 1), SeqLayout([5, 7], 5, 1), SeqLayout([30], 0, 1),
                SeqLayout(list(range(10, 35)), 98, 1), SeqLayout([39, 38, 37, 36, 6], 17, 1)]
        layout = backend.plan(seqs)
        q = torch.randn(len(seqs), 6, head_dim, generator=g)
        got = triton.decode_attention(q, cache.kv[1], layout.decode_tables, layout.decode_lens, 4,
                                      head_dim ** -0.5, window)
        worst = max(worst, (got.double() - _reference_decode(cache, 1, q, seqs, window)).abs().max().item())
ok = triton.self_check(torch.device("cpu"), torch.float32, 6, 2, 64, 16, None)
print(worst, ok)
"""


def test_the_cuda_triton_kernel_reads_what_the_block_tables_say_under_the_interpreter():
    """The CUDA decode kernel, run on the CPU by Triton's interpreter (in a fresh process: the
    mode is fixed when triton is imported), against the float64 reference: head sizes 16/64/128,
    with and without a window, float32 (the interpreter mishandles bf16; on a GPU the engine's
    start-up self-check covers the real dtype)."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", TRITON_CHECK], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    worst, self_check = done.stdout.split()
    assert float(worst) < 1e-5 and self_check == "True"


def test_decode_graphs_in_cpu_emulation_give_the_eager_tokens_and_never_hand_out_the_scratch_block(loaded):
    """The CUDA-graph decode path (static buffers, batches padded to captured sizes, padding rows
    writing into a scratch block) emulated on the CPU: capture is the only part that needs a GPU.
    Staggered arrivals make every batch size from 1 to 7 occur, most of them padded (5 -> 8)."""
    from engine_worker.cuda_graphs import capture_sizes

    assert capture_sizes(8) == [1, 2, 4, 8] and capture_sizes(20) == [1, 2, 4, 8, 16, 20] and capture_sizes(1) == [1]
    reqs = [(PROMPT[i:] + PROMPT[:i], SamplingParams(temperature=0.0, max_tokens=6 + 2 * i, ignore_eos=True))
            for i in range(7)] + [(PROMPT[:5], hot(3, 9))]
    eager, _ = run(make_runner(loaded, cuda_graphs=False), reqs, stagger=True)
    runner = make_runner(loaded, cuda_graphs=True)
    graphs = runner.graphs
    assert graphs is not None and graphs.emulated and graphs.sizes == [1, 2, 4, 8]  # passed its self-check
    assert runner.kv.num_blocks == runner.num_blocks + 1  # the scratch block
    used: list[int] = []
    replays = []
    original = graphs.run

    def spy(ids, positions, slots, tables, lens):
        replays.append(len(ids))
        used.extend(tables.flatten().tolist())
        return original(ids, positions, slots, tables, lens)

    graphs.run = spy
    got, sched = run(runner, reqs, stagger=True)
    assert [toks(o) for o in got] == [toks(o) for o in eager]
    assert set(replays) >= {1, 5, 7} and graphs.scratch_block not in used
    assert sched.block_manager.num_used == 0


def test_a_block_id_outside_the_pool_is_refused_before_any_kernel_reads_it():
    from engine_worker.attention import BACKENDS, SeqLayout
    from engine_worker.kv_cache import PagedKVCache

    cache = PagedKVCache(1, 8, 4, 2, 16, torch.float32, CPU)
    for backend in BACKENDS.values():  # planning needs no kernel: every backend's plan checks
        for table in ([3, 8], [-1, 2]):
            with pytest.raises(ValueError, match="outside the pool"):
                backend(cache, 4).plan([SeqLayout(table, 5, 1)])


def test_a_generating_model_embeds_by_last_token_pooling_alone_and_in_a_busy_batch(loaded):
    """An embedding request on a decoder: the final-norm hidden state of its last prompt token, the
    very vector the LM head reads, so the head's argmax over it is the first greedy token."""
    from protocol import PoolRequest

    runner = make_runner(loaded, num_blocks=128)

    def pooled(reqs, gen=()):
        sched = Scheduler(runner, 8, 64)
        for r in reqs:
            assert sched.add_pool(r) is None
        for i, sp in enumerate(gen):
            assert sched.add(Sequence(f"g{i}", list(PROMPT[: 5 + i]), sp)) is None
        outs = run_until_done(sched)
        return {rid: o[-1] for rid, o in outs.items()}

    raw = pooled([PoolRequest("e", tuple(PROMPT), normalize=False)])["e"]
    assert raw.num_prompt_tokens == len(PROMPT) and len(raw.data) == loaded.config.hidden_size
    greedy = toks(run(runner, [(PROMPT, SamplingParams(temperature=0.0, max_tokens=1))])[0][0])
    with torch.inference_mode():
        logits = runner.model.lm_head(torch.tensor(raw.data)[None])
    assert int(logits.argmax()) == greedy[0]

    unit = pooled([PoolRequest("e", tuple(PROMPT))])["e"]
    assert abs(sum(x * x for x in unit.data) - 1.0) < 1e-5
    busy = pooled([PoolRequest("e", tuple(PROMPT)), PoolRequest("c", tuple(PROMPT), dimensions=16)],
                  gen=[hot(1, 20), hot(None, 20), hot(2, 20)])
    assert max(abs(a - b) for a, b in zip(busy["e"].data, unit.data)) < 1e-4
    assert len(busy["c"].data) == 16
    sched = Scheduler(runner, 8, 64)
    assert "does not classify" in sched.add_pool(PoolRequest("x", (1, 2), task="classify"))


def test_the_default_context_is_lowered_to_what_the_kv_cache_holds_and_a_given_one_is_refused(loaded):
    """Without --max-model-len an engine takes the model's own context (vLLM's default), lowered to what its KV
    cache holds; a context the user asked for that the cache cannot hold is a boot error that says so."""
    cfg = loaded.config
    per_block = PagedKVCache.bytes_per_block(cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    own = cfg.max_position_embeddings
    fitted = ModelRunner(loaded, CPU, torch.float32, max_num_seqs=2, max_model_len=own, block_size=4,
                         kv_cache_bytes=10 * per_block, fit_context=True)
    assert (fitted.num_blocks, fitted.max_model_len) == (10, 40)
    roomy = ModelRunner(loaded, CPU, torch.float32, max_num_seqs=1, max_model_len=own, block_size=16,
                        fit_context=True)
    assert roomy.max_model_len == own == 8192
    with pytest.raises(ValueError, match="less than one max_model_len=8192 request"):
        ModelRunner(loaded, CPU, torch.float32, max_num_seqs=2, max_model_len=own, block_size=4,
                    kv_cache_bytes=10 * per_block)
