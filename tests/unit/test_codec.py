"""The wire codec: every message type round-trips; malformed frames raise ProtocolError."""

from __future__ import annotations

import orjson
import pytest

from protocol import (
    PROTOCOL_VERSION,
    AbortRequest,
    AddRequest,
    ClientHello,
    EngineHello,
    EngineStats,
    ErrorMessage,
    PoolOutput,
    PoolOutputs,
    PoolRequest,
    ProtocolError,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    TopLogprobs,
    TranscribeOutput,
    TranscribeOutputs,
    TranscribeRequest,
    TranscriptSegment,
    decode,
    encode,
)
from protocol.codec import MAX_FRAME_BYTES

SAMPLES = [
    ClientHello("gw0-123"),
    EngineHello(rank=1, model_id="m", max_num_seqs=8, max_model_len=2048, vocab_size=49152, eos_token_ids=(2,),
                pid=42, device="cpu", dtype="float32"),
    AddRequest("req-1", (1, 2, 3, 49151), SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, seed=3,
                                                      stop_token_ids=(5, 6), logit_bias=((10, -2.5),), logprobs=2)),
    AddRequest("req-2", tuple(range(5000))),
    AbortRequest(("a", "b")),
    StepOutputs(0, (
        RequestOutput("a", (5, 6), None, (-0.5, -1.25), TopLogprobs(2, (5, 7, 6, 8), (-0.5, -2.0, -1.25, -3.0)), 12),
        RequestOutput("b", (9,), "stop"),
        RequestOutput("c", (), "error", error="boom"),
        RequestOutput("d", (7,), "error", error="no token continues the grammar", error_code="structured_output"),
    )),
    StepOutputs(3, ()),
    StepOutputs(1, (
        RequestOutput("p", (4,), None, (-0.125,), None, 5, prompt_logprobs=(-1.5, -0.25, -3.0, -0.5),
                      prompt_top_logprobs=TopLogprobs(2, (1, 2, 3, 4, 5, 6, 7, 8), (-1.0, -2.0) * 4),
                      num_cached_tokens=16),
        RequestOutput("q", (5,), "length", prompt_logprobs=(-0.5,)),
        RequestOutput("r", (6,), prompt_logprobs=()),
    )),
    AddRequest("req-3", (7, 8), SamplingParams(prompt_logprobs=3, logprobs=0, priority=-2)),
    EngineStats(rank=0, running=3, waiting=1, kv_used=0.25, generated_tokens=100, steps=40, timestamp=1.5),
    EngineStats(rank=2, running=3, waiting=4, kv_used=0.5, generated_tokens=100, steps=40, timestamp=1.5, preempted=1,
                preemptions=7, kv_blocks_used=512, kv_blocks_total=1024, prefix_cache_hit_rate=0.375,
                prefix_cache_hits=300, prompt_tokens=800, tokens_per_step=17.5),
    ErrorMessage("bad_frame", "nope"),
    ErrorMessage("bad_frame", "nope", request_id="r"),
    AddRequest("req-4", (7,), SamplingParams(structured=("json", '{"type": "object"}'))),
    AddRequest("req-5", (7, 8), lora="sql-lora"),
    AddRequest("req-6", (7, 8), SamplingParams(max_tokens=9), output_token_ids=(4, 5), lora="org/adapter v2"),
    AddRequest("req-7", (7, 8), tenant="team-a", weight=2.5),
    StepOutputs(0, (RequestOutput("q-1", (5,), queue_time=0.125), RequestOutput("q-2", (6,)))),
    EngineHello(rank=0, model_id="e", max_num_seqs=8, max_model_len=512, vocab_size=30522, eos_token_ids=(),
                pid=42, device="cpu", dtype="float32", tasks=("embed",), embed_size=384),
    EngineHello(rank=0, model_id="c", max_num_seqs=8, max_model_len=512, vocab_size=30522, eos_token_ids=(),
                pid=42, device="cpu", dtype="float32", tasks=("classify",), labels=("neg", "pos")),
    PoolRequest("e-1", (101, 7592, 102)),
    PoolRequest("e-2", (101, 102), task="classify", normalize=False, dimensions=64),
    PoolRequest("e-3", (101, 7, 102, 8, 102), task="classify", pair_start=3),
    PoolOutputs(0, (PoolOutput("e-1", (0.25, -0.5, 1.0), 3), PoolOutput("e-2", (), 0, "too long"),
                    PoolOutput("e-3", (2.0,), 2))),
    PoolOutputs(1, ()),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    assert decode(encode(msg)) == msg


def test_token_ids_travel_as_binary_frames():
    frames = encode(AddRequest("r", tuple(range(1000))))
    assert len(frames) == 2 and len(frames[1]) == 4000
    assert b"999" not in frames[0]


def test_an_add_requests_lora_adapter_travels_in_its_header_only_when_set():
    plain, named = encode(AddRequest("r", (1, 2))), encode(AddRequest("r", (1, 2), lora="sql"))
    assert b"lora" not in plain[0] and orjson.loads(named[0])["lora"] == "sql" and named[1] == plain[1]
    assert decode(named).lora == "sql" and decode(plain).lora is None
    h = orjson.loads(named[0])
    for bad, words in [("", "lora must be an adapter name"), ("a\nb", "lora must be an adapter name"),
                       ("x" * 257, "lora must be an adapter name"), (None, "lora must be an adapter name when"),
                       (7, "lora must be an adapter name when")]:
        with pytest.raises(ProtocolError, match=words) as ei:
            decode([orjson.dumps({**h, "lora": bad}), named[1]])
        assert ei.value.request_id == "r"
    with pytest.raises(ProtocolError, match="lora must be"):
        AddRequest("r", (1,), lora="")


def test_an_add_requests_tenant_travels_only_with_a_tenants_file_and_is_checked():
    plain, named = encode(AddRequest("r", (1, 2))), encode(AddRequest("r", (1, 2), tenant="team-a", weight=3))
    assert b"tenant" not in plain[0] and b"weight" not in plain[0]
    assert (decode(named).tenant, decode(named).weight, decode(plain).tenant) == ("team-a", 3, "")
    h = orjson.loads(named[0])
    for change, words in [({"tenant": "a b"}, "tenant must be"), ({"tenant": 7}, "tenant and weight"),
                          ({"weight": 0}, "weight must be"), ({"weight": "2"}, "weight must be"),
                          ({"weight": 1e9}, "weight must be")]:
        with pytest.raises(ProtocolError, match=words):
            decode([orjson.dumps({**h, **change}), named[1]])
    with pytest.raises(ProtocolError, match="tenant and weight"):
        decode([orjson.dumps({k: v for k, v in h.items() if k != "weight"}), named[1]])


def _header(**kw) -> bytes:
    return orjson.dumps({"v": PROTOCOL_VERSION, **kw})


@pytest.mark.parametrize("frames, words", [
    ([], "frames"),
    ([b"not json"], "JSON"),
    ([b"[1,2]"], "object"),
    ([orjson.dumps({"v": 99, "t": "client_hello", "client_id": "x"})], "version"),
    ([orjson.dumps({"t": "client_hello", "client_id": "x"})], "version"),
    ([_header(t="launch_missiles")], "unknown message type"),
    ([_header(t="client_hello", client_id=5)], "client_id"),
    ([_header(t="client_hello", client_id="x", extra=1)], "unknown fields"),
    ([_header(t="client_hello")], "client_hello"),
    ([_header(t="abort", request_ids=[])], "request_ids"),
    ([_header(t="abort", request_ids=["x" * 500])], "request_id"),
    ([_header(t="stats", rank=0, running=-1, waiting=0, kv_used=0.1, generated_tokens=0, steps=0,
              timestamp=0)], "running"),
    ([_header(t="stats", rank=0, running=1, waiting=0, kv_used=2.0, generated_tokens=0, steps=0,
              timestamp=0)], "kv_used"),
    ([_header(t="stats", rank=True, running=1, waiting=0, kv_used=0.1, generated_tokens=0, steps=0,
              timestamp=0)], "rank"),
    ([_header(t="stats", rank=0, running=1, waiting=0, kv_used=0.1, generated_tokens=0, steps=0, timestamp=0,
              preempted=-1)], "preempted"),
    ([_header(t="stats", rank=0, running=1, waiting=0, kv_used=0.1, generated_tokens=0, steps=0, timestamp=0,
              kv_blocks_used=5, kv_blocks_total=4)], "kv_blocks_used"),
    ([_header(t="stats", rank=0, running=1, waiting=0, kv_used=0.1, generated_tokens=0, steps=0, timestamp=0,
              prefix_cache_hit_rate=1.5)], "prefix_cache_hit_rate"),
    ([_header(t="stats", rank=0, running=1, waiting=0, kv_used=0.1, generated_tokens=0, steps=0, timestamp=0,
              tokens_per_step="many")], "tokens_per_step"),
])
def test_malformed_frames_are_rejected(frames, words):
    with pytest.raises(ProtocolError, match=words):
        decode(frames)


def _add_frames(**sampling) -> list[bytes]:
    return encode(AddRequest("rid-7", (1, 2, 3), SamplingParams(**sampling)))


def test_truncated_token_frame_is_rejected_with_request_id():
    head, toks = _add_frames()
    with pytest.raises(ProtocolError) as ei:
        decode([head, toks[:-2]])
    assert ei.value.request_id == "rid-7"
    with pytest.raises(ProtocolError, match="n_prompt"):
        decode([head, toks[:-4]])
    with pytest.raises(ProtocolError):
        decode([head])


def test_wrong_typed_sampling_fields_are_rejected():
    head, toks = _add_frames()
    h = orjson.loads(head)
    for field, bad in [("temperature", "hot"), ("max_tokens", 0), ("max_tokens", 1.5), ("top_p", 0), ("seed", "x"),
                       ("logprobs", 21), ("prompt_logprobs", 21), ("prompt_logprobs", -1), ("prompt_logprobs", True),
                       ("priority", 1.5), ("priority", 1 << 40), ("stop_token_ids", [-1]), ("logit_bias", [[1, 500]]),
                       ("ignore_eos", 1)]:
        h2 = {**h, "sampling": {**h["sampling"], field: bad}}
        with pytest.raises(ProtocolError) as ei:
            decode([orjson.dumps(h2), toks])
        assert ei.value.request_id == "rid-7", field
    with pytest.raises(ProtocolError, match="unknown sampling"):
        decode([orjson.dumps({**h, "sampling": {"evil": 1}}), toks])


def test_oversized_frame_is_rejected_before_parsing():
    head, _ = _add_frames()
    with pytest.raises(ProtocolError, match="exceeds"):
        decode([head, b"\0" * (MAX_FRAME_BYTES + 4)])


def test_outputs_whose_arrays_disagree_with_items_are_rejected():
    frames = encode(StepOutputs(0, (RequestOutput("a", (1, 2)),)))
    assert len(frames) == 2 and len(frames[1]) == 8  # all eight arrays in one frame: here two int32 tokens
    head = orjson.loads(frames[0])
    with pytest.raises(ProtocolError, match="length does not match"):
        decode([frames[0], frames[1][:4]])
    with pytest.raises(ProtocolError, match="length does not match"):
        decode([frames[0], frames[1] + frames[1]])
    with pytest.raises(ProtocolError, match="more values"):  # lens and the frame agree, the items do not
        decode([orjson.dumps({**head, "lens": [4, 0, 0, 0, 0, 0, 0, 0]}), frames[1] + frames[1]])
    for lens in ([2, 0, 0], [2, 0, 0, 0, 0, 0, 0], [2, 0, 0, 0, 0, 0, 0, -1], [2.0, 0, 0, 0, 0, 0, 0, 0], "2"):
        with pytest.raises(ProtocolError, match="lens"):
            decode([orjson.dumps({**head, "lens": lens}), frames[1]])
    with pytest.raises(ProtocolError):
        decode(frames[:1])
    with pytest.raises(ProtocolError, match="negative"):
        decode([frames[0], b"\xff\xff\xff\xff" + frames[1][4:]])


@pytest.mark.parametrize("field, bad", [("rid", ""), ("rid", 7), ("rid", "x" * 129), ("finish", "exploded"),
                                        ("np", -1), ("np", "3"), ("nc", True), ("err", 5), ("err", "e" * 5000)])
def test_a_plain_output_is_checked_field_by_field(field, bad):
    """Outputs without logprobs skip RequestOutput's own checks (the codec makes them): each bad field is refused."""
    frames = encode(StepOutputs(0, (RequestOutput("a", (1, 2), num_prompt_tokens=3),)))
    head = orjson.loads(frames[0])
    head["items"][0][field] = bad
    with pytest.raises(ProtocolError):
        decode([orjson.dumps(head), frames[1]])


def test_a_plain_output_decodes_equal_to_the_checked_one():
    sent = StepOutputs(3, (RequestOutput("a", (1, 2), num_prompt_tokens=3, num_cached_tokens=2),
                           RequestOutput("b", (5,), "stop"), RequestOutput("c", (), "error", error="boom")))
    got = decode(encode(sent))
    assert got == sent and all(type(o) is RequestOutput for o in got.outputs)


def test_building_an_invalid_message_fails_too():
    with pytest.raises(ProtocolError):
        AddRequest("", (1,))
    with pytest.raises(ProtocolError):
        AddRequest("r", ())
    with pytest.raises(ProtocolError):
        RequestOutput("r", (1,), "exploded")


def test_prompt_logprobs_frames_that_disagree_with_items_are_rejected():
    msg = StepOutputs(0, (RequestOutput("a", (1,), prompt_logprobs=(-1.0, -2.0),
                                        prompt_top_logprobs=TopLogprobs(1, (3, 4), (-0.5, -0.25))),))
    frames = encode(msg)
    head = orjson.loads(frames[0])
    assert len(frames) == 2 and head["lens"] == [1, 0, 0, 0, 2, 2, 2, 0]  # two prompt logprobs, top-1 of each
    data = frames[1]

    def with_lens(lens: list[int], frame: bytes) -> list[bytes]:
        return [orjson.dumps({**head, "lens": lens}), frame]

    with pytest.raises(ProtocolError):  # one prompt logprob short
        decode(with_lens([1, 0, 0, 0, 1, 2, 2, 0], data[:8] + data[12:]))
    with pytest.raises(ProtocolError, match="more values"):
        decode(with_lens([1, 0, 0, 0, 4, 2, 2, 0], data[:12] + data[4:12] + data[12:]))
    with pytest.raises(ProtocolError):  # top-k arrays too short for k * n
        decode(with_lens([1, 0, 0, 0, 2, 1, 1, 0], data[:16] + data[20:24]))
    bad = dict(head)
    bad["items"] = [dict(head["items"][0], pk="two")]
    with pytest.raises(ProtocolError):
        decode([orjson.dumps(bad), data])
    item = dict(head["items"][0], pk=1)
    del item["plp"]
    with pytest.raises(ProtocolError, match="without prompt logprobs"):
        decode([orjson.dumps({**head, "items": [item]}), data])


def test_prompt_ranks_travel_with_prompt_logprobs_and_must_match_them():
    msg = StepOutputs(0, (RequestOutput("a", (1,), prompt_logprobs=(-1.0, -2.0), prompt_ranks=(1, 7)),
                          RequestOutput("b", (2,))))
    frames = encode(msg)
    assert decode(frames) == msg
    head = orjson.loads(frames[0])
    assert head["lens"] == [2, 0, 0, 0, 2, 0, 0, 2]
    with pytest.raises(ProtocolError):  # a rank short
        decode([orjson.dumps({**head, "lens": [2, 0, 0, 0, 2, 0, 0, 1]}), frames[1][:-4]])
    item = dict(head["items"][0])
    del item["plp"]
    with pytest.raises(ProtocolError, match="without prompt logprobs"):
        decode([orjson.dumps({**head, "items": [item, head["items"][1]]}), frames[1]])
    for ranks in ((1,), (0, 1), (1.5, 2)):
        with pytest.raises(ProtocolError, match="prompt_ranks"):
            RequestOutput("r", (1,), prompt_logprobs=(-1.0, -2.0), prompt_ranks=ranks)


def test_prompt_top_logprobs_need_matching_sizes():
    with pytest.raises(ProtocolError):
        RequestOutput("r", (1,), prompt_logprobs=(-1.0,), prompt_top_logprobs=TopLogprobs(2, (1,), (-1.0,)))
    with pytest.raises(ProtocolError):
        RequestOutput("r", (1,), prompt_top_logprobs=TopLogprobs(1, (1,), (-1.0,)))
    with pytest.raises(ProtocolError):
        RequestOutput("r", (1,), num_cached_tokens=-1)


def test_pooled_vectors_travel_as_one_float_frame_and_must_match_their_items():
    frames = encode(PoolOutputs(0, (PoolOutput("a", (1.0,) * 384, 5), PoolOutput("b", (0.5,) * 384, 7))))
    assert len(frames) == 2 and len(frames[1]) == 2 * 384 * 4
    with pytest.raises(ProtocolError, match="data frame"):
        decode([frames[0], frames[1] + b"\0\0\0\0"])
    with pytest.raises(ProtocolError, match="does not match"):
        decode([frames[0], frames[1][:-4]])
    with pytest.raises(ProtocolError):
        PoolOutput("c", (), 1)  # neither data nor an error
    with pytest.raises(ProtocolError, match="task"):
        PoolRequest("d", (1,), task="generate")


def test_sampling_params_fast_check_accepts_and_refuses_exactly_what_the_full_checks_do(monkeypatch):
    """``SamplingParams`` checks the common case in one expression; over random field values, valid and not, of
    exact and odd types, it must accept and refuse exactly what the field-by-field checks alone do."""
    import random
    from enum import IntEnum

    class Odd(IntEnum):  # an int subclass: only the full checks may judge it
        ONE = 1

    values = {
        "max_tokens": [1, 16, 0, -1, 1 << 21, 2.0, True, Odd.ONE],
        "temperature": [0.0, 1.0, 0, 100.0, 100.5, -0.1, True, "1"],
        "top_p": [1.0, 0.5, 0.0, 1.5, 1],
        "top_k": [0, 1, -1, 1 << 21, 1.0, Odd.ONE],
        "min_p": [0.0, 1.0, 1.1, -0.1],
        "seed": [None, 0, -(1 << 63), (1 << 64) - 1, 1 << 64, -(1 << 63) - 1, 1.0],
        "min_tokens": [0, 1, 17, -1],
        "stop_token_ids": [(), (2,), (-1,), [2]],
        "ignore_eos": [False, True, 0],
        "presence_penalty": [0.0, 2.0, -2.1],
        "frequency_penalty": [0.0, -2.0, 2.5],
        "repetition_penalty": [1.0, 10.0, 0.0, 10.5],
        "logit_bias": [(), ((1, 1.0),), ((1, 200.0),)],
        "logprobs": [None, 0, 20, 21],
        "prompt_logprobs": [None, 5, -1],
        "priority": [0, -(1 << 31), 1 << 31],
        "structured": [None, ("json", "{}"), ("xml", "x")],
    }

    def verdict(kw) -> str | None:
        try:
            SamplingParams(**kw)
        except ProtocolError as e:
            return str(e)
        return None

    rng = random.Random(5)
    cases = [{k: rng.choice(v) if rng.random() < 0.3 else v[0] for k, v in values.items()} for _ in range(3000)]
    fast = [verdict(kw) for kw in cases]
    monkeypatch.setattr(SamplingParams, "_plain_and_valid", lambda self: False)
    assert fast == [verdict(kw) for kw in cases]
    assert None in fast and any(v is not None for v in fast)


def test_speech_messages_round_trip_with_the_audio_in_a_binary_frame():
    pcm = bytes(range(256)) * 10
    req = TranscribeRequest("tr-1", pcm, "translate", "fr", (50360, 7), 0.2, True, True, "client-9")
    frames = encode(req)
    assert len(frames) == 3 and frames[2] == pcm and b"audio" not in frames[0]
    assert decode(frames) == req
    seg = TranscriptSegment(500, 5.0, 8.5, (14, 15), 0.2, -0.31, 1.4, 0.02, (5.0, 6.1, 8.5))
    out = TranscribeOutputs(3, (TranscribeOutput("tr-1", (seg,), "fr", 40.0, False),
                                TranscribeOutput("tr-2", (), "", 1.0, True, "engine error: boom")))
    assert decode(encode(out)) == out


@pytest.mark.parametrize(("change", "words"), [
    (lambda h, f: (h, f[:2]), "a header, a prompt frame and an audio frame"),
    (lambda h, f: ({**h, "extra": 1}, f), "transcribe needs exactly"),
    (lambda h, f: ({**h, "task": "sing"}, f), "task must be one of"),
    (lambda h, f: ({**h, "language": "en us"}, f), "language must be a short code"),
    (lambda h, f: ({**h, "temperature": 9}, f), "temperature must be in"),
    (lambda h, f: (h, [f[0], f[1], b"odd"]), "16-bit PCM"),
])
def test_malformed_transcribe_frames_are_rejected(change, words):
    frames = encode(TranscribeRequest("tr-1", b"\0\0" * 8, prompt_token_ids=(1, 2)))
    head = orjson.loads(frames[0])
    head, frames = change(head, frames)
    with pytest.raises(ProtocolError, match=words):
        decode([orjson.dumps(head), *frames[1:]])


def test_transcribed_segments_are_checked():
    good = TranscriptSegment(0, 0.0, 1.0, (5,), word_times=(0.0, 1.0)).to_wire()
    for bad, words in (({**good, "start": 2.0}, "out of order"), ({**good, "wt": [0.0]}, "one time per token"),
                       ({**good, "tokens": [-1]}, "token ids"), ({k: v for k, v in good.items() if k != "lp"},
                                                                  "malformed transcript segment")):
        head = {"v": PROTOCOL_VERSION, "t": "transcribed", "rank": 0,
                "items": [{"rid": "a", "segments": [bad], "lang": "en", "dur": 1.0, "done": True}]}
        with pytest.raises(ProtocolError, match=words):
            decode([orjson.dumps(head)])
