"""An engine's KV cache events on the wire (``protocol.kv_events``): a PUB socket every subscriber reads, and a replay
socket that answers a subscriber who missed batches.

The block manager appends an event for every block it registers, evicts or forgets; after each step (and after an
operation such as a cache reset) the server hands them here, and they go out as one batch with the next sequence
number. The last ``REPLAY_BUFFER`` batches are kept: a subscriber that sees a gap, or one that starts late, asks the
replay socket for every batch from a sequence number on (vLLM's protocol: the 8-byte number in, ``[seq, payload]``
messages out, then ``[END_SEQ, b""]``). Over TCP (an engine host) both sockets take CURVE like the engine's own.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import zmq

from protocol.kv_events import (
    DEFAULT_TOPIC,
    END_SEQ,
    REPLAY_BUFFER,
    KvEvent,
    encode_batch,
    replay_endpoint,
    seq_bytes,
    seq_of,
)
from protocol.validate import ProtocolError
from zserve.curve import CurveKeys, bind, secure_server

log = logging.getLogger("zserve.engine")


class KvEventPublisher:
    def __init__(self, ctx: zmq.Context, endpoint: str, keys: CurveKeys | None = None, topic: bytes = DEFAULT_TOPIC,
                 buffer: int = REPLAY_BUFFER):
        self.endpoint, self.replay_at = endpoint, replay_endpoint(endpoint)
        self.topic = topic
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if keys is not None:
            secure_server(self.pub, keys, "KV events")
            secure_server(self.replay, keys, "KV event replay")
        bind(self.pub, endpoint, "the KV event publisher")
        bind(self.replay, self.replay_at, "the KV event replay socket")
        self.seq = -1
        self.kept: deque[tuple[int, bytes]] = deque(maxlen=buffer)

    def publish(self, events: list[KvEvent]) -> None:
        """Send ``events`` (and empty the list) as the next batch; nothing when there are none."""
        if not events:
            return
        self.seq += 1
        payload = encode_batch(events, time.time())
        events.clear()
        self.kept.append((self.seq, payload))
        try:
            self.pub.send_multipart([self.topic, seq_bytes(self.seq), payload], flags=zmq.NOBLOCK)
        except zmq.Again:  # a subscriber this far behind asks for a replay
            pass

    def serve_replay(self) -> None:
        """Answer every replay request waiting (the engine polls this socket with its own)."""
        while True:
            try:
                frames = self.replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            who, *rest = frames
            envelope = [who, b""] if len(rest) == 2 and rest[0] == b"" else [who]  # REQ sends an empty delimiter
            try:
                start = seq_of(rest[-1])
            except (ProtocolError, IndexError):
                log.warning("KV event replay: dropped a request that is no 8-byte sequence number")
                continue
            for seq, payload in self.kept:
                if seq >= start:
                    self._send(envelope + [seq_bytes(seq), payload])
            self._send(envelope + [END_SEQ, b""])

    def _send(self, frames: list[bytes]) -> None:
        try:
            self.replay.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def close(self) -> None:
        self.pub.close(0)
        self.replay.close(0)
