"""KV cache events (``protocol.kv_events``, ``engine_worker.kv_publisher``): vLLM's wire format, decoded here with
vLLM's own message types (msgspec structs written from its documented fields), the block manager's events and the
hashes a gateway computes from token ids alone, the publisher's sequence numbers and its replay."""

from __future__ import annotations

import msgpack
import msgspec
import pytest
import zmq

from engine_worker.block_manager import BlockManager
from engine_worker.kv_publisher import KvEventPublisher
from protocol.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    adapter_id,
    block_hash,
    chain_root,
    decode_batch,
    encode_batch,
    prefix_hashes,
    seq_bytes,
)
from protocol.validate import ProtocolError


# vLLM's types, as its documentation lists their fields (array-like, tagged structs).
class _Event(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class VllmBlockStored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VllmBlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class VllmAllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


class VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


def test_a_batch_is_what_vllm_decodes_and_decodes_back():
    events = [BlockStored((11, 12), 7, tuple(range(8)), 4, adapter_id("sql"), None), BlockRemoved((11,), "GPU"),
              AllBlocksCleared()]
    payload = encode_batch(events, ts=12.5)
    theirs = msgspec.msgpack.Decoder(VllmBatch).decode(payload)
    assert theirs.ts == 12.5 and [type(e).__name__ for e in theirs.events] == [
        "VllmBlockStored", "VllmBlockRemoved", "VllmAllBlocksCleared"]
    assert theirs.events[0].block_hashes == [11, 12] and theirs.events[0].token_ids == list(range(8))
    assert decode_batch(payload) == (12.5, events)


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1.0, [["Nope"]]]),
                                     msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2], 4, None, None]]]),
                                     msgpack.packb([1.0, [["BlockRemoved", "x"]]])])
def test_malformed_batches_are_refused(payload):
    with pytest.raises(ProtocolError):
        decode_batch(payload)


def test_the_block_manager_tells_what_it_stores_evicts_and_forgets_in_hashes_a_gateway_computes():
    events: list = []
    bm = BlockManager(2, 4, events=events)
    root = chain_root("m")
    tokens = list(range(100, 108))
    table = bm.allocate(2)
    parent = root
    for i in range(2):
        parent = bm.register(table[i], parent, tuple(tokens[4 * i:4 * i + 4]))
    expected = prefix_hashes(tokens, 4, root)  # what a gateway computes from the token ids alone
    assert [e.block_hashes[0] for e in events] == expected and events[0].parent_block_hash == root
    assert chain_root("m") != chain_root("m", "adapter") != chain_root("other")  # model and adapter are in it
    bm.free(table)
    events.clear()
    bm.allocate(1)  # the least recently used cached block is evicted
    assert events == [BlockRemoved((expected[1],))]
    bm.reset()
    assert events[-1] == AllBlocksCleared() and bm.num_cached == 0
    assert block_hash(None, (1, 2)) == block_hash(None, [1, 2]) != block_hash(0, (1, 2))


def test_batches_carry_sequence_numbers_and_a_late_subscriber_replays_them(tmp_path):
    ctx = zmq.Context.instance()
    pub = KvEventPublisher(ctx, f"ipc://{tmp_path}/e-kv.sock")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    try:
        # (a PUB drops what it sends before the subscription arrives: publish until one is read)
        for _ in range(200):
            pub.publish([AllBlocksCleared()])
            if sub.poll(20):
                break
        topic, seq, payload = sub.recv_multipart()
        first = int.from_bytes(seq, "big")
        assert topic == b"" and decode_batch(payload)[1] == [AllBlocksCleared()]
        pub.publish([])  # nothing to say: no batch, no number
        pub.publish([BlockRemoved((5,))])
        _, seq, _ = sub.recv_multipart()
        assert int.from_bytes(seq, "big") == pub.seq == first + 1  # one number per batch
        req = ctx.socket(zmq.DEALER)  # (a REQ socket reads one answer: a replay is several)
        req.connect(pub.replay_at)
        req.send_multipart([b"", seq_bytes(pub.seq - 1)])  # REQ's envelope: an empty frame, then the number
        assert pub.replay.poll(2000)
        pub.serve_replay()  # (every answer goes out at once)
        got = []
        while not got or got[-1][0] != END_SEQ:
            assert req.poll(2000), got
            got.append(req.recv_multipart()[1:])
        assert [int.from_bytes(f[0], "big", signed=True) for f in got] == [pub.seq - 1, pub.seq, -1]
        assert decode_batch(got[1][1])[1] == [BlockRemoved((5,))] and got[-1][1] == b""
        req.close(0)
    finally:
        sub.close(0)
        pub.close()


def test_an_unloaded_adapters_blocks_are_forgotten_and_its_hashes_are_what_a_gateway_computes():
    events: list = []
    bm = BlockManager(8, 4, events=events)
    root = chain_root("m", "sql")  # the scheduler's root of an adapter's requests: the same on every engine
    tokens = list(range(8))
    blocks = bm.allocate(2)
    hashes = [bm.register(blocks[0], root, tuple(tokens[:4]), "sql")]
    hashes.append(bm.register(blocks[1], hashes[0], tuple(tokens[4:]), "sql"))
    other = bm.allocate(1)
    bm.register(other[0], chain_root("m"), tuple(tokens[:4]))  # the base model's: kept
    assert hashes == prefix_hashes(tokens, 4, root)
    events.clear()
    bm.forget_adapter("sql")
    assert {h for e in events for h in e.block_hashes} == set(hashes)
    assert bm.lookup(tokens, 8, root) == [] and bm.lookup(tokens, 8, chain_root("m")) == other


def test_the_fast_readings_agree_with_the_format():
    tokens = [7, 70000, 3, 2**32 - 1] * 9  # 36 tokens: two full blocks of 16 and a partial one
    parent, chained = None, []
    for i in range(2):
        parent = block_hash(parent, tokens[i * 16:(i + 1) * 16])
        chained.append(parent)
    assert prefix_hashes(tokens, 16, None) == chained
    assert prefix_hashes(tokens, 16, chain_root("m")) != chained
    from protocol.kv_events import CLEARED, REMOVED, STORED, block_changes

    payload = encode_batch([BlockStored((1, 2), None, tuple(range(8)), 4), BlockRemoved((2,)), AllBlocksCleared()],
                           ts=5.5)
    assert block_changes(payload) == (5.5, [(STORED, [1, 2]), (REMOVED, [2]), (CLEARED, [])])
    for bad in (b"\x01", msgpack.packb(["late", []]), msgpack.packb([0.0, [["BlockStored", ["x"]]]]),
                msgpack.packb([0.0, [["Nope", []]]])):
        with pytest.raises(ProtocolError):
            block_changes(bad)


def test_a_prompt_is_told_stored_on_arrival_touched_again_and_taken_back_if_it_never_runs():
    from engine_worker.scheduler import Scheduler
    from engine_worker.sequence import Sequence
    from protocol import SamplingParams
    from tests.unit.test_scheduler import FakeRunner, _run_step

    s = Scheduler(FakeRunner(), max_num_seqs=1, max_num_batched_tokens=64)
    events: list = []
    s.block_manager.events = events
    prompt = list(range(10, 22))  # three full blocks of 4, and one more token
    expected = prefix_hashes(prompt, 4, chain_root(""))

    def stored():
        return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]

    s.add(Sequence("a", [*prompt, 1], SamplingParams(max_tokens=1)))
    assert stored() == expected and events[0].parent_block_hash == chain_root("")
    assert list(events[0].token_ids) == prompt  # vLLM's fields: an external router reads the tokens too
    s.add(Sequence("b", [*prompt, 2], SamplingParams(max_tokens=1)))  # the same prefix, waiting behind a
    s.add(Sequence("c", [*prompt[:8], 9, 9, 9, 9, 3], SamplingParams(max_tokens=1)))  # shares two blocks
    c_hashes = prefix_hashes([*prompt[:8], 9, 9, 9, 9], 4, chain_root(""))
    assert stored() == [*expected, *expected, *c_hashes]  # each arrival tells (or touches) its prompt's blocks
    events.clear()
    _run_step(s)  # a computes its blocks and finishes: nothing told again, nothing taken back
    assert events == []
    c_own = c_hashes[2]
    s.abort("c")  # c computed nothing: its own block is taken back, the shared ones stay (a computed them)
    assert events == [BlockRemoved((c_own,))]
    events.clear()
    s.abort("b")
    assert events == []  # b's blocks are a's, computed and cached
    refused = Sequence("d", [5] * 12, SamplingParams(max_tokens=1, structured=("regex", "a+")))
    assert s.add(refused) is not None and events == []  # a request the engine refuses tells nothing


def test_a_replay_port_another_process_holds_is_an_error_that_names_the_socket_and_the_endpoint():
    """The KV event ports of an engine host are fixed: one held by another socket (a client's source port once
    took one) is a ``BindError`` naming the socket and the endpoint, which the engine process logs as one line
    before exiting 1 for the supervisor to restart it (``Engine.run``), not a traceback."""
    import socket

    from tests.helpers import free_ports
    from zserve.curve import BindError

    ctx = zmq.Context.instance()
    first = free_ports(2)
    port = first + 1
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        with pytest.raises(BindError) as refused:
            KvEventPublisher(ctx, f"tcp://127.0.0.1:{first}")
    assert f"the KV event replay socket at tcp://127.0.0.1:{port}" in str(refused.value)
    assert "in use" in str(refused.value)
