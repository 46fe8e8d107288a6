"""Prefix-affine routing (``gateway.routing``) and the index it reads (``gateway.kv_index``): blocks stored, removed
and cleared; gaps, restarts and replays (against a real publisher's sockets); the longest match, the rendezvous tie
break every gateway computes alike, and the bound on a hot prefix's share."""

from __future__ import annotations

import asyncio
import random
from collections import Counter, OrderedDict
from types import SimpleNamespace

import pytest
import zmq

from engine_worker.kv_publisher import KvEventPublisher
from gateway.kv_index import EngineBlocks, KvFollower
from gateway.routing import Router, busy
from protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    chain_root,
    encode_batch,
    prefix_hashes,
)

BS = 16
MODEL = "m"
ROOT = chain_root(MODEL)


def stored(*hashes: int) -> BlockStored:
    return BlockStored(tuple(hashes), None, tuple(range(BS)) * len(hashes), BS)


def batch(*events) -> bytes:
    return encode_batch(list(events), 0.0)


# -- the index ------------------------------------------------------------------------------------------------------

def test_stored_removed_and_cleared_blocks_make_the_index():
    st = EngineBlocks()
    for payload in (batch(stored(1, 2, 3)), batch(BlockRemoved((2,))), batch(stored(4))):
        st.live(st.next_seq, payload)
    assert st.blocks.keys() == {1, 3, 4}
    st.live(st.next_seq, batch(AllBlocksCleared(), stored(7)))
    assert st.blocks.keys() == {7} and st.next_seq == 4


def test_a_gap_waits_for_the_replay_and_applies_in_order():
    st = EngineBlocks()
    st.live(0, batch(stored(1)))
    assert st.live(2, batch(BlockRemoved((5,)), stored(6))) is True  # 1 is missing: a replay is wanted
    assert st.blocks.keys() == {1}
    st.replaying = True
    assert st.live(3, batch(stored(7))) is False  # already asked
    st.replayed(1, batch(stored(5)))
    st.replayed(2, batch(BlockRemoved((5,)), stored(6)))
    st.replay_done()
    assert st.blocks.keys() == {1, 6, 7} and st.next_seq == 4 and not st.pending and st.stale == 0


def test_what_the_replay_no_longer_keeps_is_skipped_and_counted():
    st = EngineBlocks()
    st.replaying = True
    st.live(9, batch(stored(9)))
    st.replayed(5, batch(stored(5)))  # the engine kept 5.. only
    st.replay_done()  # 6..8 never came either
    assert st.blocks.keys() == {5, 9} and st.next_seq == 10 and st.stale == 2


def test_a_restarted_engine_starts_again_from_zero_and_malformed_batches_change_nothing():
    st = EngineBlocks()
    for seq in range(3):
        st.live(seq, batch(stored(seq + 1)))
    st.live(1, batch(stored(99)))  # a duplicate (a replay brought it): ignored
    assert st.blocks.keys() == {1, 2, 3}
    st.live(0, batch(stored(42)))  # a new process publishes from 0 again: its cache is a new one
    assert st.blocks.keys() == {42} and st.restarts == 1
    for bad in (b"\x00garbage", batch()[:-1], encode_batch([], 0.0)[:1]):
        st.live(st.next_seq, bad)
    assert st.blocks.keys() == {42} and st.malformed == 3


async def _until(cond, what: str, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def test_a_late_follower_catches_up_by_replay_and_fills_a_lost_batch(tmp_path):
    asyncio.run(_late_follower(tmp_path))


async def _late_follower(tmp_path) -> None:
    ctx = zmq.Context.instance()
    pub = KvEventPublisher(ctx, f"ipc://{tmp_path}/kv.sock")
    stop = asyncio.Event()

    async def serve_replays():  # the engine polls its replay socket between steps
        while not stop.is_set():
            pub.serve_replay()
            await asyncio.sleep(0.005)

    server = asyncio.create_task(serve_replays())
    try:
        hashes = prefix_hashes(list(range(64)), BS, ROOT)
        for h in hashes[:3]:  # published before anyone listened
            pub.publish([stored(h)])
        f = KvFollower(ctx, pub.endpoint)
        await _until(lambda: f.state.blocks.keys() == set(hashes[:3]) and not f.state.replaying, "the replay")
        await _until(lambda: (pub.publish([stored(hashes[3])]), hashes[3] in f.state.blocks)[1],
                     "the live subscription")
        pub.seq += 1  # a batch the subscriber never gets live (dropped), kept for replay
        pub.kept.append((pub.seq, batch(BlockRemoved((hashes[0],)))))
        pub.publish([BlockRemoved((hashes[1],))])
        await _until(lambda: f.state.blocks.keys() == {hashes[2], hashes[3]}, "the gap to be replayed")
        assert f.state.next_seq == pub.seq + 1 and f.state.stale == 0
        f.close()
    finally:
        stop.set()
        await server
        pub.close()


# -- the scoring ------------------------------------------------------------------------------------------------------

def engine(rank: int, running: int = 0, waiting: int = 0, outstanding: int = 0, kv_blocks: int = 0):
    e = SimpleNamespace(endpoint=f"ipc://engine-{rank}", rank=rank, outstanding=outstanding, sent_since_stats=0,
                        hello=SimpleNamespace(kv_block_size=BS, model_id=MODEL),
                        stats=SimpleNamespace(running=running, waiting=waiting, kv_blocks_total=kv_blocks))
    e.load = outstanding + waiting
    return e


def router(engines, held: dict[int, set[int] | dict[int, float]], **kw) -> Router:
    """A router over ``engines`` whose indexes hold ``held`` (by rank: hashes, or hashes with when each was last
    told stored, oldest first)."""
    followers = {}
    for e in engines:
        st = EngineBlocks()
        blocks = held.get(e.rank, ())
        st.blocks = OrderedDict(blocks.items() if isinstance(blocks, dict) else dict.fromkeys(blocks, 0.0))
        followers[e.endpoint] = SimpleNamespace(state=st)
    decisions = []
    r = Router(followers=followers, on_decision=lambda m, reason, rank: decisions.append((reason, rank)), **kw)
    r.decisions = decisions
    return r


def prompt(prefix: int, suffix: int, n_prefix: int = 512, n_suffix: int = 64) -> list[int]:
    rng = random.Random(prefix)
    head = [rng.randrange(1000) for _ in range(n_prefix)]
    rng = random.Random(10_000 + suffix)
    return head + [rng.randrange(1000) for _ in range(n_suffix)]


def test_the_engine_holding_the_longest_prefix_wins():
    es = [engine(0), engine(1), engine(2)]
    p = prompt(1, 1)
    hs = prefix_hashes(p, BS, ROOT)
    r = router(es, {0: set(hs[:4]), 1: set(hs[:20]), 2: set(hs[5:])})  # 2 holds later blocks only: it finds none
    assert r.pick(es, p, MODEL, None) is es[1] and r.decisions[-1] == ("cache", 1)
    # An adapter's blocks chain from another root: the base model's blocks are no match.
    assert r.pick(es, p, MODEL, "sql").rank in (0, 1, 2) and r.decisions[-1][0] == "hash"


def test_every_gateway_sends_a_new_prefix_to_the_same_engine_and_prefixes_spread():
    es = [engine(0), engine(1)]
    choices = {}
    for prefix in range(40):
        picks = {router(es, {}).pick(es, prompt(prefix, s), MODEL, None).rank for s in range(5)}
        assert len(picks) == 1, "requests sharing a new prefix (the same first block) reach one engine"
        choices[prefix] = picks.pop()
    spread = Counter(choices.values())
    assert min(spread.values()) >= 10, f"new prefixes spread over the engines: {spread}"


def test_a_prefix_several_engines_hold_keeps_the_one_holding_it_longest_unless_it_is_hot():
    es = [engine(0), engine(1)]
    hs = prefix_hashes(prompt(3, 0), BS, ROOT)[:32]  # the 512-token prefix of 36 blocks
    r = router(es, {0: set(hs), 1: set(hs)})
    r.followers[es[0].endpoint].state.since = dict.fromkeys(hs, 9.0)
    r.followers[es[1].endpoint].state.since = dict.fromkeys(hs, 5.0)  # 1 held it first: 0 has a spill's copy
    es[1].outstanding = es[1].load = 3  # (loads alone do not move it: the bound does)
    homes = {r.pick(es, prompt(3, s), MODEL, None).rank for s in range(20)}
    assert homes == {1} and r.decisions[-1] == ("cache", 1)
    # This gateway has a request of it in flight: a hot prefix, shared by load among those holding it.
    assert r.pick(es, prompt(3, 98), MODEL, None).rank == 1
    key = r.placed(es[1])
    assert r.pick(es, prompt(3, 99), MODEL, None).rank == 0 and r.decisions[-1] == ("load", 0)
    r.left(key)
    assert r.pick(es, prompt(3, 99), MODEL, None).rank == 1, "no longer in flight: the senior copy again"
    es[1].outstanding = es[1].load = 0
    held = set().union(*(prefix_hashes(prompt(p, 0), BS, ROOT)[:32] for p in range(40)))
    r = router(es, {0: held, 1: held})
    homes = Counter(r.pick(es, prompt(p, 7), MODEL, None).rank for p in range(40))
    assert min(homes[0], homes[1]) >= 10, f"prefixes both hold since the same time spread by their hash: {homes}"


def test_a_new_prefix_goes_where_it_evicts_the_least_recently_used_blocks():
    # Room left: the emptier cache, and this gateway counts what it placed until the engine tells of it.
    es = [engine(0, kv_blocks=200), engine(1, kv_blocks=200)]
    r = router(es, {0: set(range(1, 41)), 1: set(range(100, 110))})
    assert r.pick(es, prompt(1, 0), MODEL, None).rank == 1 and r.decisions[-1] == ("room", 1)
    placed = Counter(r.pick(es, prompt(p, 0), MODEL, None).rank for p in range(2, 10))
    assert placed == {0: 4, 1: 4}, f"new prefixes of one gateway fill both caches evenly: {placed}"
    # Full caches: the one whose blocks it would evict were used longest ago, the same from every gateway.
    es = [engine(0, kv_blocks=100), engine(1, kv_blocks=100)]
    recent = {h: 1000.0 + h for h in range(100)}  # used a second ago, all of them
    stale = {**{h: 10.0 + h for h in range(200, 260)}, **{h: 1000.0 + h for h in range(260, 300)}}
    for held, home in (({0: recent, 1: stale}, 1), ({0: stale, 1: recent}, 0)):
        picks = {router(es, held).pick(es, prompt(7, s), MODEL, None).rank for s in range(5)}
        assert picks == {home}, "a prefix new to both goes where the blocks it pushes out are stalest"
    # As much room on both: rendezvous hashing of its first block, as any gateway computes it.
    picks = {router(es, {0: stale, 1: stale}).pick(es, prompt(7, s), MODEL, None).rank for s in range(5)}
    assert len(picks) == 1


def test_the_index_keeps_blocks_in_the_order_the_engine_last_told_them():
    st = EngineBlocks()
    st.live(0, encode_batch([stored(1, 2, 3)], ts=1.0))
    st.live(1, encode_batch([stored(4)], ts=2.0))
    st.live(2, encode_batch([stored(1)], ts=3.0))  # 1 told again: a request found it cached
    assert list(st.blocks) == [2, 3, 4, 1]
    assert [st.stalest(n) for n in (1, 3, 4, 9)] == [1.0, 2.0, 3.0, 3.0]


def test_a_hot_prefix_fills_its_engine_to_the_bound_and_spills():
    es = [engine(0), engine(1)]
    p = prompt(4, 0, n_prefix=4096)  # so long that only the bound makes a request go where it is not cached
    r = router(es, {0: set(prefix_hashes(p, BS, ROOT)[:256])}, max_share=1.5)
    sent = Counter()
    for s in range(40):  # every request stays: loads grow as they are routed
        e = r.pick(es, prompt(4, s, n_prefix=4096), MODEL, None)
        e.outstanding += 1
        sent[e.rank] += 1
        fair = sum(sent.values()) / len(es)
        assert busy(e) <= max(1, -(-1.5 * fair // 1)), "no engine past the bound"
    assert sent[0] == 30 and sent[1] == 10  # 1.5 x the fair share of 20
    assert ("bound", 1) in r.decisions and r.decisions[0] == ("cache", 0)


def test_a_short_cached_run_is_not_worth_waiting_behind_a_busier_engine():
    es = [engine(0, outstanding=3), engine(1)]
    long, short = prompt(5, 0, n_prefix=1024), prompt(6, 0, n_prefix=256)  # 64 and 16 blocks cached on engine 0
    r = router(es, {0: set(prefix_hashes(long, BS, ROOT)[:64]) | set(prefix_hashes(short, BS, ROOT)[:16])})
    assert r.pick(es, prompt(5, 1, n_prefix=1024), MODEL, None).rank == 0 and r.decisions[-1] == ("cache", 0)
    assert r.pick(es, prompt(6, 1, n_prefix=256), MODEL, None).rank == 1 and r.decisions[-1] == ("load", 1)
    es[0].outstanding = 1  # 256 cached tokens are worth more than one request ahead
    assert r.pick(es, prompt(6, 1, n_prefix=256), MODEL, None).rank == 0


def test_short_prompts_no_events_and_the_other_policies_route_by_load():
    es = [engine(0, waiting=3), engine(1, waiting=1)]
    r = router(es, {})
    assert r.pick(es, list(range(BS - 1)), MODEL, None) is es[1] and r.decisions[-1] == ("load", 1)
    assert Router(followers={}).pick(es, prompt(1, 1), MODEL, None) is es[1]  # no engine's events followed
    r = router(es, {}, policy="load")
    assert r.pick(es, prompt(1, 1), MODEL, None) is es[1]
    rr = router(es, {}, policy="round-robin")
    assert {rr.pick(es, prompt(1, 1), MODEL, None).rank for _ in range(2)} == {0, 1}
    with pytest.raises(ValueError):
        Router(policy="random")
    broken = router(es, {})
    broken.followers[es[0].endpoint].state = None  # whatever goes wrong in scoring, the request is routed by load
    assert broken.pick(es, prompt(1, 1), MODEL, None) is es[1] and broken.decisions[-1] == ("load", 1)
