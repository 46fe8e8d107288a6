"""What every engine holds in its prefix cache, as its own KV cache events tell (``protocol.kv_events``).

Each gateway follows every engine's events: a SUB socket on the engine's PUB endpoint, and a DEALER on its replay
socket. On start (and whenever the engine is a new process) the follower asks for a replay from sequence number 0, so
a gateway that starts late, or restarts, knows what an engine cached before it came; a gap in the sequence numbers
(a batch lost, or one that came out of order) is filled the same way. A batch that arrives while a replay runs waits
until the replay has reached it. What the replay no longer keeps (an engine keeps ``REPLAY_BUFFER`` batches) is lost
to this gateway: it then knows a subset of the engine's blocks, which only makes routing to that engine less likely
(``stale`` counts it). Nothing the events say can fail a request: a malformed batch is dropped and counted.

The index is, per engine, its block hashes in the order the engine last told them stored (an engine tells a
request's prompt blocks again when it arrives, cached or not): the order in which the engine's LRU cache would evict
them, roughly, each with the time the engine told it. The router (``routing``) reads the longest run of a request's
leading block hashes an engine holds: the blocks its prefix cache would find, as the engine's own lookup stops at
the first block it does not hold; and, to place a prefix no engine holds, how recently each engine used the blocks
it would evict for it (``stalest``). Every gateway sees the same events, so every gateway computes the same
matches, whatever host it runs on and however late it started.

The sockets are read from the event loop (``loop.add_reader``, every message waiting in one callback), as the engine
client reads its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from itertools import islice

import zmq

from protocol import ProtocolError
from protocol.kv_events import (
    DEFAULT_TOPIC,
    END_SEQ,
    REMOVED,
    STORED,
    block_changes,
    replay_endpoint,
    seq_bytes,
    seq_of,
)
from zserve.curve import CurveKeys, is_tcp, secure_client

log = logging.getLogger("zserve.gateway.kv")

REPLAY_RETRY = 5.0  # seconds without a replay's end before it is asked again (the engine may have been busy)
MAX_PENDING = 4096  # live batches kept while a replay runs; past that the oldest are dropped (and refetched)


class EngineBlocks:
    """One engine's cached blocks, kept in sequence from its event batches (no sockets: ``KvFollower`` feeds it)."""

    def __init__(self) -> None:
        self.blocks: OrderedDict[int, float] = OrderedDict()  # hash -> when last told stored, oldest first
        self.since: dict[int, float] = {}  # hash -> when first told stored (since it was last removed)
        self.next_seq = 0  # the batch wanted next
        self.pending: dict[int, bytes] = {}  # batches that came before the ones they follow
        self.replaying = False
        self.replay_asked = 0.0
        self.batches = self.malformed = self.stale = self.restarts = 0

    def clear(self) -> None:
        """The engine's cache is gone (it restarted): forget it, and follow its batches from 0 again."""
        self.blocks.clear()
        self.since.clear()
        self.pending.clear()
        self.next_seq = 0

    def apply(self, payload: bytes) -> None:
        self.batches += 1
        try:
            ts, changes = block_changes(payload)
        except ProtocolError as e:
            self.malformed += 1
            log.warning("dropped a malformed KV event batch: %s", e)
            return
        blocks, since = self.blocks, self.since
        for kind, hashes in changes:
            if kind == STORED:
                last, first = blocks.move_to_end, since.setdefault
                for h in hashes:
                    blocks[h] = ts
                    last(h)
                    first(h, ts)
            elif kind == REMOVED:
                for h in hashes:
                    blocks.pop(h, None)
                    since.pop(h, None)
            else:
                blocks.clear()
                since.clear()

    def stalest(self, n: int) -> float:
        """When the engine last used the ``n``-th block it would evict first (``n`` >= 1; past the last block, the
        newest one's time)."""
        blocks = self.blocks
        if not blocks:
            return 0.0
        if n >= len(blocks):
            return blocks[next(reversed(blocks))]
        return next(islice(blocks.values(), n - 1, None))

    def live(self, seq: int, payload: bytes) -> bool:
        """A batch from the PUB socket; whether a replay is wanted (a gap before it)."""
        if seq < self.next_seq:
            if seq == 0 and not self.replaying:  # a new engine process on the same endpoint starts from 0 again
                self.restarts += 1
                self.clear()
            else:
                return False  # already applied (a replay brought it)
        if seq == self.next_seq and not self.replaying:
            self.apply(payload)
            self.next_seq += 1
            return False
        self.pending[seq] = payload
        if len(self.pending) > MAX_PENDING:
            del self.pending[min(self.pending)]
        return not self.replaying

    def replayed(self, seq: int, payload: bytes) -> None:
        """A batch of a replay's answer (in order)."""
        if seq < self.next_seq:
            return
        if seq > self.next_seq:  # the engine no longer keeps what came between: lost to this gateway
            self.stale += 1
            self.next_seq = seq
        self.apply(payload)
        self.next_seq = seq + 1

    def replay_done(self) -> None:
        """The replay's end: apply what came live meanwhile, in order; skip what no one can give any more."""
        self.replaying = False
        pending = self.pending
        while pending:
            first = min(pending)
            if first < self.next_seq:
                del pending[first]
                continue
            if first > self.next_seq:
                self.stale += 1
                self.next_seq = first
            self.apply(pending.pop(first))
            self.next_seq += 1


class KvFollower:
    """Follows one engine's KV events: its ``EngineBlocks`` kept current from the engine's sockets."""

    def __init__(self, ctx: zmq.Context, endpoint: str, keys: CurveKeys | None = None):
        self.endpoint = endpoint
        self.state = EngineBlocks()
        self.pid: int | None = None  # the engine process the index describes
        self.sub = ctx.socket(zmq.SUB)
        self.dealer = ctx.socket(zmq.DEALER)
        for s in (self.sub, self.dealer):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RECONNECT_IVL, 100)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            if keys is not None and is_tcp(endpoint):
                secure_client(s, keys)
        self.sub.setsockopt(zmq.RCVHWM, 100_000)
        self.sub.setsockopt(zmq.SUBSCRIBE, DEFAULT_TOPIC)
        self.sub.connect(endpoint)
        self.dealer.connect(replay_endpoint(endpoint))
        loop = asyncio.get_running_loop()
        loop.add_reader(self.sub.getsockopt(zmq.FD), self._pump_sub)
        loop.add_reader(self.dealer.getsockopt(zmq.FD), self._pump_replay)
        self.closed = False
        self.lost = False
        self.ask_replay()
        # ZeroMQ's descriptors signal edges: what arrived before the readers were added is read now.
        loop.call_soon(self._pump_sub)
        loop.call_soon(self._pump_replay)

    def engine_hello(self, pid: int) -> None:
        """The engine greeted this gateway. A process other than the one indexed has none of its blocks; after a
        lost connection, what it holds is asked again from the start."""
        if self.lost or (self.pid is not None and pid != self.pid):
            self.state.restarts += self.pid != pid
            self.state.clear()
            self.ask_replay()
        self.pid, self.lost = pid, False

    def engine_lost(self) -> None:
        """The engine's connection dropped (it died, or its host is cut off): route nothing by its old blocks."""
        self.state.clear()
        self.lost = True

    def ask_replay(self) -> None:
        st = self.state
        st.replaying, st.replay_asked = True, time.monotonic()
        try:
            self.dealer.send_multipart([b"", seq_bytes(st.next_seq)], flags=zmq.NOBLOCK)
        except zmq.Again:  # not connected yet: asked again once the retry time has passed
            pass

    def _pump_sub(self) -> None:
        if self.closed:
            return
        st, want = self.state, False
        while True:
            try:
                frames = self.sub.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                seq = seq_of(frames[1]) if len(frames) == 3 else None
            except ProtocolError:
                seq = None
            if seq is None:
                st.malformed += 1
                continue
            want |= st.live(seq, frames[2])
        if want or (st.replaying and time.monotonic() - st.replay_asked > REPLAY_RETRY):
            self.ask_replay()

    def _pump_replay(self) -> None:
        if self.closed:
            return
        st = self.state
        while True:
            try:
                frames = self.dealer.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            body = frames[1:] if frames and frames[0] == b"" else frames
            if len(body) != 2:
                st.malformed += 1
                continue
            if body[0] == END_SEQ:
                st.replay_done()
                continue
            try:
                st.replayed(seq_of(body[0]), body[1])
            except ProtocolError:
                st.malformed += 1

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.sub.getsockopt(zmq.FD))
        loop.remove_reader(self.dealer.getsockopt(zmq.FD))
        self.sub.close(0)
        self.dealer.close(0)
