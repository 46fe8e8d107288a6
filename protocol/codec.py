"""Encode messages to ZeroMQ multipart frames and decode them back, validating everything.

Frame 0 is an orjson header ``{"v": PROTOCOL_VERSION, "t": <type>, ...fields}``. Token ids and
logprobs follow as raw little-endian int32 / float32 frames (AddRequest and PoolRequest: the prompt's
tokens, and a migrated AddRequest's generated tokens after them, ``n_output`` of them; StepOutputs: one
frame holding eight arrays back to back, whose sizes the header's ``lens`` gives: tokens, logprobs,
top ids, top logprobs, then the same three for prompt logprobs and the prompt tokens' ranks;
PoolOutputs: every output's vector, one after another), so a 4k-token prompt costs one memcpy instead
of a JSON array. An AddRequest's header has ``lora`` only when the request names an adapter, and ``tenant``
and ``weight`` only when it has a tenant. Nothing here can execute code from a frame: no pickle, no eval.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import fields

import orjson

from .messages import (
    ALL_MESSAGES,
    FINISH_REASONS,
    MAX_ERROR_CHARS,
    MAX_REQUEST_ID_LEN,
    PROTOCOL_VERSION,
    AddRequest,
    Message,
    PoolOutput,
    PoolOutputs,
    PoolRequest,
    ProtocolError,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    TopLogprobs,
)
from .speech import TranscribeOutput, TranscribeOutputs, TranscribeRequest, TranscriptSegment

MAX_FRAME_BYTES = 64 << 20  # one binary frame (16M int32 tokens)
MAX_HEADER_BYTES = 4 << 20
MAX_FRAMES = 8

_BY_TYPE: dict[str, type[Message]] = {m.TYPE: m for m in (*ALL_MESSAGES, TranscribeRequest, TranscribeOutputs)}
_LITTLE = sys.byteorder == "little"
# one output's header
_OUTPUT_KEYS = {"rid", "n", "finish", "np", "err", "ec", "lp", "k", "nc", "plp", "pk", "pr", "qt"}


def _pack(typecode: str, values: Sequence[int] | Sequence[float]) -> bytes:
    a = array(typecode, values)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def _unpack(typecode: str, buf: bytes | memoryview, what: str) -> list:
    if len(buf) % 4:
        raise ProtocolError(f"{what} frame length {len(buf)} is not a multiple of 4")
    a = array(typecode)
    a.frombytes(buf)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


def encode(msg: Message) -> list[bytes]:
    """Return the multipart frames for ``msg``."""
    if isinstance(msg, AddRequest):
        head = {
            "request_id": msg.request_id,
            "n_prompt": len(msg.prompt_token_ids),
            "sampling": msg.sampling.to_wire(),
            "trace_id": msg.trace_id,
        }
        if msg.lora is not None:  # only when set: a base-model request's header stays as it was
            head["lora"] = msg.lora
        if msg.tenant:  # likewise: only with a tenants file
            head["tenant"], head["weight"] = msg.tenant, msg.weight
        if msg.output_token_ids:  # a migrated request: its generated tokens follow the prompt's in the frame
            head["n_output"] = len(msg.output_token_ids)
            return [_header(msg, head), _pack("i", msg.prompt_token_ids + msg.output_token_ids)]
        return [_header(msg, head), _pack("i", msg.prompt_token_ids)]
    if isinstance(msg, StepOutputs):
        return _encode_outputs(msg)
    if isinstance(msg, PoolRequest):
        head = {"request_id": msg.request_id, "n_prompt": len(msg.prompt_token_ids), "task": msg.task,
                "normalize": msg.normalize, "dimensions": msg.dimensions, "pair_start": msg.pair_start,
                "trace_id": msg.trace_id}
        return [_header(msg, head), _pack("i", msg.prompt_token_ids)]
    if isinstance(msg, PoolOutputs):
        items = []
        for o in msg.outputs:
            item: dict = {"rid": o.request_id, "n": len(o.data), "np": o.num_prompt_tokens}
            if o.error is not None:
                item["err"] = o.error
            items.append(item)
        return [_header(msg, {"rank": msg.rank, "items": items}),
                _pack("f", [x for o in msg.outputs for x in o.data])]
    if isinstance(msg, TranscribeRequest):
        head = {"request_id": msg.request_id, "n_prompt": len(msg.prompt_token_ids), "task": msg.task,
                "language": msg.language, "temperature": msg.temperature, "timestamps": msg.timestamps,
                "words": msg.words, "trace_id": msg.trace_id}
        return [_header(msg, head), _pack("i", msg.prompt_token_ids), msg.audio]
    if isinstance(msg, TranscribeOutputs):
        items = []
        for o in msg.outputs:
            item: dict = {"rid": o.request_id, "segments": [s.to_wire() for s in o.segments], "lang": o.language,
                          "dur": o.duration, "done": o.done}
            if o.error is not None:
                item["err"] = o.error
            items.append(item)
        return [_header(msg, {"rank": msg.rank, "items": items})]
    head = {f.name: getattr(msg, f.name) for f in fields(msg)}  # type: ignore[arg-type]
    return [_header(msg, head)]


def _header(msg: Message, body: dict) -> bytes:
    body = {"v": PROTOCOL_VERSION, "t": msg.TYPE, **body}
    return orjson.dumps(body)


# StepOutputs' arrays, in their order in the data frame, and each one's element type.
_OUTPUT_ARRAYS = ("tokens", "logprobs", "top ids", "top logprobs", "prompt logprobs", "prompt top ids",
                  "prompt top logprobs", "prompt ranks")
_OUTPUT_TYPES = "ififfifi"


def _encode_outputs(msg: StepOutputs) -> list[bytes]:
    items, toks, lps, top_ids, top_lps = [], [], [], [], []
    plps, ptop_ids, ptop_lps, pranks = [], [], [], []
    for o in msg.outputs:
        item: dict = {"rid": o.request_id, "n": len(o.new_token_ids)}
        if o.finish_reason is not None:
            item["finish"] = o.finish_reason
        if o.num_prompt_tokens:
            item["np"] = o.num_prompt_tokens
        if o.error is not None:
            item["err"] = o.error
            if o.error_code is not None:
                item["ec"] = o.error_code
        if o.logprobs is not None:
            item["lp"] = True
            lps.extend(o.logprobs)
        if o.top_logprobs is not None:
            item["k"] = o.top_logprobs.k
            top_ids.extend(o.top_logprobs.token_ids)
            top_lps.extend(o.top_logprobs.logprobs)
        if o.num_cached_tokens:
            item["nc"] = o.num_cached_tokens
        if o.queue_time is not None:
            item["qt"] = round(o.queue_time, 6)
        if o.prompt_logprobs is not None:
            item["plp"] = len(o.prompt_logprobs)
            plps.extend(o.prompt_logprobs)
        if o.prompt_top_logprobs is not None:
            item["pk"] = o.prompt_top_logprobs.k
            ptop_ids.extend(o.prompt_top_logprobs.token_ids)
            ptop_lps.extend(o.prompt_top_logprobs.logprobs)
        if o.prompt_ranks is not None:
            item["pr"] = True
            pranks.extend(o.prompt_ranks)
        toks.extend(o.new_token_ids)
        items.append(item)
    arrays = (toks, lps, top_ids, top_lps, plps, ptop_ids, ptop_lps, pranks)
    head = _header(msg, {"rank": msg.rank, "items": items, "lens": [len(a) for a in arrays]})
    # One data frame for all eight arrays: every ZeroMQ frame costs each side about a microsecond and a half.
    return [head, b"".join([_pack(t, a) for t, a in zip(_OUTPUT_TYPES, arrays) if a])]


def decode(frames: Sequence[bytes | memoryview]) -> Message:
    """Parse and validate frames into a message; raise ProtocolError for anything malformed."""
    if not frames or len(frames) > MAX_FRAMES:
        raise ProtocolError(f"expected 1..{MAX_FRAMES} frames, got {len(frames)}")
    for f in frames:
        if len(f) > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame of {len(f)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    if len(frames[0]) > MAX_HEADER_BYTES:
        raise ProtocolError("header frame too large")
    try:
        head = orjson.loads(frames[0])
    except orjson.JSONDecodeError as e:
        raise ProtocolError(f"header is not JSON: {e}") from None
    if not isinstance(head, dict):
        raise ProtocolError("header must be a JSON object")
    version = head.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version!r} (this side speaks {PROTOCOL_VERSION})")
    cls = _BY_TYPE.get(head.pop("t", None))  # type: ignore[arg-type]
    if cls is None:
        raise ProtocolError("unknown message type")
    rid = head.get("request_id") if isinstance(head.get("request_id"), str) else None
    try:
        if cls is AddRequest:
            return _decode_add(head, frames)
        if cls is StepOutputs:
            return _decode_outputs(head, frames)
        if cls is PoolRequest:
            return _decode_pool(head, frames)
        if cls is PoolOutputs:
            return _decode_pooled(head, frames)
        if cls is TranscribeRequest:
            return _decode_transcribe(head, frames)
        if cls is TranscribeOutputs:
            return _decode_transcribed(head, frames)
        if len(frames) != 1:
            raise ProtocolError(f"{cls.TYPE} takes exactly one frame")
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = set(head) - names
        if unknown:
            raise ProtocolError(f"unknown fields {sorted(unknown)} in {cls.TYPE}")
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in head.items()}
        return cls(**kw)
    except ProtocolError as e:
        e.request_id = e.request_id or rid
        raise
    except (TypeError, ValueError, KeyError) as e:
        raise ProtocolError(f"bad {cls.TYPE} message: {e}", rid) from None


def _prompt_frame(head: dict, frames: Sequence[bytes | memoryview], what: str, extra: int = 0) -> tuple[int, ...]:
    if len(frames) != 2:
        raise ProtocolError(f"{what} takes a header and one token frame")
    ids = _unpack("i", frames[1], "prompt")
    if len(ids) != head["n_prompt"] + extra:
        raise ProtocolError("prompt frame length does not match n_prompt" + (" + n_output" if extra else ""))
    if ids and min(ids) < 0:
        raise ProtocolError("negative token id in prompt")
    return tuple(ids)


def _decode_pool(head: dict, frames: Sequence[bytes | memoryview]) -> PoolRequest:
    if set(head) != {"request_id", "n_prompt", "task", "normalize", "dimensions", "pair_start", "trace_id"}:
        raise ProtocolError("pool needs exactly request_id, n_prompt, task, normalize, dimensions, pair_start, "
                            "trace_id")
    return PoolRequest(head["request_id"], _prompt_frame(head, frames, "pool"), head["task"], head["normalize"],
                       head["dimensions"], head["pair_start"], head["trace_id"])


def _decode_pooled(head: dict, frames: Sequence[bytes | memoryview]) -> PoolOutputs:
    if set(head) != {"rank", "items"} or not isinstance(head["items"], list):
        raise ProtocolError("pooled needs exactly rank and a list of items")
    if len(frames) != 2:
        raise ProtocolError("pooled takes a header and one data frame")
    data = _unpack("f", frames[1], "pooled data")
    at = 0
    outs = []
    for item in head["items"]:
        if not isinstance(item, dict) or not set(item) <= {"rid", "n", "np", "err"}:
            raise ProtocolError("malformed pooled item")
        n = item.get("n")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0 or at + n > len(data):
            raise ProtocolError("pooled item size does not match the data frame")
        outs.append(PoolOutput(item.get("rid"), tuple(data[at : at + n]), item.get("np", 0),  # type: ignore[arg-type]
                               item.get("err")))
        at += n
    if at != len(data):
        raise ProtocolError("the data frame holds more values than the items claim")
    return PoolOutputs(head["rank"], tuple(outs))


_TRANSCRIBE_KEYS = {"request_id", "n_prompt", "task", "language", "temperature", "timestamps", "words", "trace_id"}


def _decode_transcribe(head: dict, frames: Sequence[bytes | memoryview]) -> TranscribeRequest:
    if set(head) != _TRANSCRIBE_KEYS:
        raise ProtocolError(f"transcribe needs exactly {', '.join(sorted(_TRANSCRIBE_KEYS))}")
    if len(frames) != 3:
        raise ProtocolError("transcribe takes a header, a prompt frame and an audio frame")
    prompt = _prompt_frame(head, frames[:2], "transcribe")
    return TranscribeRequest(head["request_id"], bytes(frames[2]), head["task"], head["language"], prompt,
                             head["temperature"], head["timestamps"], head["words"], head["trace_id"])


def _decode_transcribed(head: dict, frames: Sequence[bytes | memoryview]) -> TranscribeOutputs:
    if set(head) != {"rank", "items"} or not isinstance(head["items"], list):
        raise ProtocolError("transcribed needs exactly rank and a list of items")
    if len(frames) != 1:
        raise ProtocolError("transcribed takes exactly one frame")
    outs = []
    for item in head["items"]:
        if not isinstance(item, dict) or not {"rid", "segments", "lang", "dur", "done"} <= set(item) <= {
                "rid", "segments", "lang", "dur", "done", "err"} or not isinstance(item["segments"], list):
            raise ProtocolError("malformed transcribed item")
        outs.append(TranscribeOutput(item["rid"], tuple(TranscriptSegment.from_wire(s) for s in item["segments"]),
                                     item["lang"], item["dur"], item["done"], item.get("err")))
    return TranscribeOutputs(head["rank"], tuple(outs))


def _decode_add(head: dict, frames: Sequence[bytes | memoryview]) -> AddRequest:
    if set(head) - {"n_output", "lora", "tenant", "weight"} != {"request_id", "n_prompt", "sampling", "trace_id"}:
        raise ProtocolError("add needs exactly request_id, n_prompt, sampling, trace_id (and n_output, lora, tenant, "
                            "weight)")
    if ("tenant" in head) != ("weight" in head) or not isinstance(head.get("tenant", ""), str):
        raise ProtocolError("tenant and weight come together, tenant a name")
    if "lora" in head and not isinstance(head["lora"], str):
        raise ProtocolError("lora must be an adapter name when present")
    n_output = head.get("n_output", 0)
    if not isinstance(n_output, int) or isinstance(n_output, bool) or n_output < 0 or ("n_output" in head
                                                                                         and not n_output):
        raise ProtocolError("n_output must be a positive int")
    if not isinstance(head["n_prompt"], int) or isinstance(head["n_prompt"], bool):
        raise ProtocolError("n_prompt must be an int")
    ids = _prompt_frame(head, frames, "add", n_output)
    n = len(ids) - n_output
    return AddRequest(head["request_id"], ids[:n], SamplingParams.from_wire(head["sampling"]), head["trace_id"],
                      ids[n:], head.get("lora"), head.get("tenant", ""), head.get("weight", 1.0))


def _decode_outputs(head: dict, frames: Sequence[bytes | memoryview]) -> StepOutputs:
    if set(head) != {"rank", "items", "lens"} or not isinstance(head["items"], list):
        raise ProtocolError("outputs needs exactly rank, items and lens")
    if len(frames) != 2:
        raise ProtocolError("outputs takes a header and one data frame")
    lens = head["lens"]
    if not isinstance(lens, list) or len(lens) != len(_OUTPUT_ARRAYS) \
            or not all(type(n) is int and n >= 0 for n in lens):
        raise ProtocolError("lens must list the sizes of the eight arrays")
    data = memoryview(frames[1])
    if len(data) != 4 * sum(lens):
        raise ProtocolError("the data frame's length does not match lens")
    arrays, at = [], 0
    for typecode, n, what in zip(_OUTPUT_TYPES, lens, _OUTPUT_ARRAYS):
        arrays.append(_unpack(typecode, data[at: at + 4 * n], what) if n else [])
        at += 4 * n
    toks, lps, top_ids, top_lps, plps, ptop_ids, ptop_lps, pranks = arrays
    if toks and min(toks) < 0:  # int32 ids: none is 2**31 or more
        raise ProtocolError("negative token id in outputs")
    n_toks = len(toks)
    t = lp = tp = pl = ptp = pr = 0
    outs = []
    for item in head["items"]:
        if type(item) is not dict or not item.keys() <= _OUTPUT_KEYS:
            raise ProtocolError("malformed output item")
        n = item.get("n")
        if type(n) is not int or n < 0 or t + n > n_toks:
            raise ProtocolError("output item token count does not match the tokens array")
        new = tuple(toks[t : t + n])
        t += n
        if len(item) <= 5 and not item.keys() & _SLOW_KEYS:  # the common case, checked here
            rid, finish, err = item.get("rid"), item.get("finish"), item.get("err")
            n_prompt, n_cached = item.get("np", 0), item.get("nc", 0)
            if type(rid) is not str or not 0 < len(rid) <= MAX_REQUEST_ID_LEN or (
                    finish is not None and finish not in FINISH_REASONS) or type(n_prompt) is not int \
                    or n_prompt < 0 or type(n_cached) is not int or n_cached < 0 or (
                    err is not None and (type(err) is not str or len(err) > MAX_ERROR_CHARS)):
                _refuse_plain(item)
            # Built without RequestOutput's own checks (or the frozen dataclass's setattr per field): this runs
            # for every streamed token.
            outs.append(RequestOutput.checked(rid, new, finish, n_prompt, err, n_cached))
            continue
        logprobs = None
        if item.get("lp"):
            if lp + n > len(lps):
                raise ProtocolError("logprobs array too short")
            logprobs = tuple(lps[lp : lp + n])
            lp += n
        top = None
        if "k" in item:
            k = item["k"]
            if not isinstance(k, int) or k < 0 or tp + k * n > len(top_ids) or len(top_ids) != len(top_lps):
                raise ProtocolError("top logprobs arrays do not match")
            top = TopLogprobs(k, tuple(top_ids[tp : tp + k * n]), tuple(top_lps[tp : tp + k * n]))
            tp += k * n
        prompt_lp = prompt_top = ranks = None
        if "plp" in item:
            m = item["plp"]
            if not isinstance(m, int) or isinstance(m, bool) or m < 0 or pl + m > len(plps):
                raise ProtocolError("prompt logprobs array does not match")
            prompt_lp = tuple(plps[pl : pl + m])
            pl += m
            if "pk" in item:
                pk = item["pk"]
                if not isinstance(pk, int) or isinstance(pk, bool) or pk < 0 or ptp + pk * m > len(ptop_ids):
                    raise ProtocolError("prompt top logprobs arrays do not match")
                prompt_top = TopLogprobs(pk, tuple(ptop_ids[ptp : ptp + pk * m]), tuple(ptop_lps[ptp : ptp + pk * m]))
                ptp += pk * m
            if item.get("pr"):
                if pr + m > len(pranks):
                    raise ProtocolError("prompt ranks array too short")
                ranks = tuple(pranks[pr : pr + m])
                pr += m
        elif "pk" in item or "pr" in item:
            raise ProtocolError("prompt top logprobs or ranks without prompt logprobs")
        outs.append(
            RequestOutput(
                request_id=item.get("rid"),  # type: ignore[arg-type]
                new_token_ids=new,
                finish_reason=item.get("finish"),
                logprobs=logprobs,
                top_logprobs=top,
                num_prompt_tokens=item.get("np", 0),
                error=item.get("err"),
                prompt_logprobs=prompt_lp,
                prompt_top_logprobs=prompt_top,
                num_cached_tokens=item.get("nc", 0),
                prompt_ranks=ranks,
                error_code=item.get("ec"),
                queue_time=item.get("qt"),
            )
        )
    if t != n_toks or lp != len(lps) or tp != len(top_ids) or pl != len(plps) or ptp != len(ptop_ids) \
            or pr != len(pranks) or len(top_ids) != len(top_lps) or len(ptop_ids) != len(ptop_lps):
        raise ProtocolError("the arrays hold more values than the items claim")
    return StepOutputs(head["rank"], tuple(outs))


_LOGPROB_KEYS = frozenset({"lp", "k", "plp", "pk", "pr"})
_SLOW_KEYS = _LOGPROB_KEYS | {"ec", "qt"}  # an item with any of these takes the checked path


def _refuse_plain(item: dict) -> None:
    """Raise the error that ``RequestOutput``'s checks would for this output item without logprobs."""
    rid, finish, err = item.get("rid"), item.get("finish"), item.get("err")
    if type(rid) is not str or not 0 < len(rid) <= MAX_REQUEST_ID_LEN:
        raise ProtocolError("request_id must be a non-empty str of at most 128 chars")
    if finish is not None and finish not in FINISH_REASONS:
        raise ProtocolError(f"unknown finish_reason {finish!r}", rid)
    if err is not None and (type(err) is not str or len(err) > MAX_ERROR_CHARS):
        raise ProtocolError("error must be a short str", rid)
    raise ProtocolError("num_prompt_tokens and num_cached_tokens must be counts", rid)
