"""KV cache events: what an engine's prefix cache stores and evicts, in vLLM's wire format, and the block hashes both
tiers compute the same way.

Each engine publishes on a ZeroMQ PUB socket multipart messages ``[topic, seq, payload]``: ``seq`` an 8-byte
big-endian sequence number (one per batch, from 0), ``payload`` a msgpack array ``[ts, [event, ...]]`` whose events
are msgspec's array-like tagged structs, the tag first:

- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``
- ``["BlockRemoved", block_hashes, medium]``
- ``["AllBlocksCleared"]``

A subscriber that sees a gap asks the engine's replay socket (a ROUTER; a DEALER client sends an empty frame and
the 8-byte sequence number to start from) and gets every batch it still keeps as ``[seq, payload]`` messages, then
``[END_SEQ, b""]``. This is vLLM's format (``vllm.distributed.kv_events``), so routers written for vLLM (llm-d,
Dynamo, SGLang's gateway) can follow zserve's engines.

Block hashes are zserve's own, stable across processes and hosts: ``block_hash(parent, tokens)`` chains a 64-bit
BLAKE2b over the block's tokens and its parent's hash, the first block's parent being ``chain_root(model, adapter)``
(so the model and the adapter are part of every hash). A gateway computes a request's hashes from its token ids
exactly as the engine that caches them does. Bump nothing here without both tiers: the format is the contract.
"""

from __future__ import annotations

import hashlib
import struct
import sys
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

import msgpack

from .validate import ProtocolError, check

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_TOPIC = b""  # vLLM's default: a subscriber to b"" gets every batch
REPLAY_BUFFER = 10_000  # batches an engine keeps for replay


def block_hash(parent: int | None, tokens: tuple[int, ...] | list[int]) -> int:
    """The hash of a full block of ``tokens`` whose previous block hashed to ``parent`` (None: no root): BLAKE2b-64
    of the parent's 8 big-endian bytes (8 x 0xff for none) and the tokens as little-endian uint32."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"\xff" * 8 if parent is None else parent.to_bytes(8, "big"))
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(h.digest(), "big")


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int | None) -> Iterator[int]:
    """``block_hash`` chained over every full block of ``token_ids`` from ``parent`` on, lazily (a caller may stop
    at the first it has no use for), the tokens packed once (half the cost of packing each block)."""
    n = len(token_ids) // block_size
    if not n:
        return
    data = array("I", token_ids[:n * block_size])
    if sys.byteorder != "little":
        data.byteswap()
    raw, step, blake = memoryview(data).cast("B"), block_size * 4, hashlib.blake2b
    for i in range(n):
        head = b"\xff" * 8 if parent is None else parent.to_bytes(8, "big")
        parent = int.from_bytes(blake(head + raw[i * step:(i + 1) * step], digest_size=8).digest(), "big")
        yield parent


@lru_cache(maxsize=1024)
def chain_root(model: str, adapter: str | None = None) -> int:
    """The parent of a request's first block: KV computed by another model, or through another LoRA adapter, is
    another chain."""
    return int.from_bytes(hashlib.blake2b(f"{model}\0{adapter or ''}".encode(), digest_size=8).digest(), "big")


def prefix_hashes(token_ids: Sequence[int], block_size: int, root: int | None) -> list[int]:
    """The chained hashes of every full block of ``token_ids``."""
    return list(chain_hashes(token_ids, block_size, root))


def adapter_id(name: str | None) -> int | None:
    """vLLM's ``lora_id`` of an adapter (an int; zserve names adapters): stable across engines."""
    if name is None:
        return None
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "big")


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None

    def to_wire(self) -> list:
        return ["BlockStored", list(self.block_hashes), self.parent_block_hash, list(self.token_ids),
                self.block_size, self.lora_id, self.medium]


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None

    def to_wire(self) -> list:
        return ["BlockRemoved", list(self.block_hashes), self.medium]


@dataclass(frozen=True)
class AllBlocksCleared:
    def to_wire(self) -> list:
        return ["AllBlocksCleared"]


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_batch(events: list[KvEvent], ts: float | None = None) -> bytes:
    return msgpack.packb([time.time() if ts is None else ts, [e.to_wire() for e in events]])


def _ints(v: object, what: str) -> tuple[int, ...]:
    check(isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v),
          f"{what} must be a list of integers")
    return tuple(v)  # type: ignore[arg-type]


def _optional(v: object, kind: type, what: str) -> None:
    check(v is None or (isinstance(v, kind) and not isinstance(v, bool)), f"{what} must be a {kind.__name__} or nil")


def decode_batch(payload: bytes) -> tuple[float, list[KvEvent]]:
    """A batch as published; ``ProtocolError`` for anything else (a subscriber drops it and asks for a replay)."""
    try:
        body = msgpack.unpackb(payload, strict_map_key=True)
    except (ValueError, msgpack.UnpackException, TypeError) as e:
        raise ProtocolError(f"not a msgpack event batch: {e}") from None
    check(isinstance(body, list) and len(body) >= 2 and isinstance(body[0], (int, float))
          and isinstance(body[1], list), "an event batch is [ts, [events]]")
    events: list[KvEvent] = []
    for e in body[1]:
        check(isinstance(e, list) and e and isinstance(e[0], str), "an event is [tag, fields...]")
        tag, fields = e[0], e[1:]
        if tag == "BlockStored":
            check(len(fields) >= 4, "BlockStored needs hashes, parent, token ids and block size")
            hashes, parent, tokens, size = fields[:4]
            lora, medium = (fields[4:] + [None, None])[:2]
            _optional(parent, int, "parent_block_hash")
            _optional(lora, int, "lora_id")
            _optional(medium, str, "medium")
            check(isinstance(size, int) and size > 0, "block_size must be a positive integer")
            stored = BlockStored(_ints(hashes, "block_hashes"), parent, _ints(tokens, "token_ids"), size, lora, medium)
            check(len(stored.token_ids) == size * len(stored.block_hashes), "token_ids must fill every block")
            events.append(stored)
        elif tag == "BlockRemoved":
            check(len(fields) >= 1, "BlockRemoved needs hashes")
            medium = fields[1] if len(fields) > 1 else None
            _optional(medium, str, "medium")
            events.append(BlockRemoved(_ints(fields[0], "block_hashes"), medium))
        elif tag == "AllBlocksCleared":
            events.append(AllBlocksCleared())
        else:
            raise ProtocolError(f"unknown KV event {tag!r}")
    return float(body[0]), events


STORED, REMOVED, CLEARED = 0, 1, 2


def block_changes(payload: bytes) -> tuple[float, list[tuple[int, list[int]]]]:
    """When a batch was published and what it does to the set of cached blocks, as ``(STORED | REMOVED | CLEARED,
    block hashes)``: a router's reading of ``decode_batch``, which checks only what it uses (an engine's token ids
    cost it 10 times more to check than to read). ``ProtocolError`` for a batch that is not one."""
    try:
        body = msgpack.unpackb(payload, strict_map_key=True)
    except (ValueError, msgpack.UnpackException, TypeError) as e:
        raise ProtocolError(f"not a msgpack event batch: {e}") from None
    check(isinstance(body, list) and len(body) >= 2 and isinstance(body[0], (int, float))
          and isinstance(body[1], list), "an event batch is [ts, [events]]")
    out: list[tuple[int, list[int]]] = []
    for e in body[1]:
        check(isinstance(e, list) and e and isinstance(e[0], str), "an event is [tag, fields...]")
        tag = e[0]
        if tag == "AllBlocksCleared":
            out.append((CLEARED, []))
            continue
        check(tag in ("BlockStored", "BlockRemoved") and len(e) >= 2, f"unknown or short KV event {tag!r}")
        hashes = e[1]
        check(isinstance(hashes, list) and all(type(h) is int for h in hashes), "block_hashes must be integers")
        out.append((STORED if tag == "BlockStored" else REMOVED, hashes))
    return float(body[0]), out


def replay_endpoint(endpoint: str) -> str:
    """The replay socket beside a PUB endpoint: ``…-kv.sock`` → ``…-kv-replay.sock``, a TCP port → the next one."""
    if endpoint.startswith("ipc://"):
        base = endpoint.removesuffix(".sock")
        return f"{base}-replay.sock"
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + 1}"


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    check(len(frame) == 8, "a sequence number is 8 bytes")
    return int.from_bytes(frame, "big", signed=True)
