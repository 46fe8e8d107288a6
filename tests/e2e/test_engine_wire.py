"""An engine that receives hostile frames drops them and keeps serving."""

from __future__ import annotations

import re

import httpx
import orjson
import zmq

from protocol import AddRequest, ClientHello, SamplingParams, StepOutputs, decode, encode
from protocol.codec import MAX_FRAME_BYTES


def _endpoint(url: str) -> str:
    return httpx.get(url + "/load").json()["engines"][0]["endpoint"]


def _recv_until(sock: zmq.Socket, pred, timeout_ms: int = 10000):
    while sock.poll(timeout_ms):
        msg = decode(sock.recv_multipart())
        if pred(msg):
            return msg
    raise AssertionError("no matching reply from the engine")


def _client(url: str, name: str) -> zmq.Socket:
    """A DEALER connected to the first engine behind ``url``, past the hello exchange."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(_endpoint(url))
    sock.send_multipart(encode(ClientHello(name)))
    _recv_until(sock, lambda m: m.TYPE == "engine_hello")
    return sock


def test_engine_survives_bad_frames_and_keeps_serving(tiny_server):
    ctx = zmq.Context.instance()
    sock = _client(tiny_server.url, "evil-client")
    try:
        # garbage, truncated, unknown version, wrong types, oversized
        good_head, good_toks = encode(AddRequest("victim", (1, 2, 3), SamplingParams(max_tokens=2)))
        sock.send_multipart([b"\x80garbage"])
        sock.send_multipart([good_head, good_toks[:-1]])
        sock.send_multipart([orjson.dumps({"v": 999, "t": "add"})])
        sock.send_multipart([good_head.replace(b'"max_tokens":2', b'"max_tokens":"many"'), good_toks])
        # a well-formed request with a token outside the vocabulary ends with an error, not a crash
        sock.send_multipart(encode(AddRequest("oob", (10**9,), SamplingParams(max_tokens=2))))
        err = _recv_until(sock, lambda m: isinstance(m, StepOutputs) and any(o.request_id == "oob" for o in m.outputs))
        assert err.outputs[0].finish_reason == "error" and "vocabulary" in err.outputs[0].error
        # the typed-bad request was answered with an error for its id
        # and a good request on the same socket still completes
        sock.send_multipart(encode(AddRequest("good", (1, 2, 3),
                                              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))))
        toks = []
        while True:
            m = _recv_until(sock, lambda m: isinstance(m, StepOutputs)
                            and any(o.request_id == "good" for o in m.outputs))
            out = next(o for o in m.outputs if o.request_id == "good")
            toks += out.new_token_ids
            if out.finish_reason:
                break
        assert out.finish_reason == "length" and len(toks) == 3
    finally:
        sock.close(0)
    # a frame over the socket's size cap: ZeroMQ drops that connection, the engine carries on
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.connect(_endpoint(tiny_server.url))
    big.send(b"\0" * (MAX_FRAME_BYTES + (2 << 20)))
    big.close(0)
    r = httpx.post(tiny_server.url + "/v1/completions", json={"model": "tiny-random", "prompt": "hi", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 200


def test_engine_constrains_a_request_to_its_grammar_over_the_wire(tiny_server):
    """A live engine process compiles the spec on its compile thread (building the grammar's view of
    the vocabulary from the model's tokenizer) and ends the request when the grammar is complete."""
    from zserve.catalog import smollm2_gguf_path
    from zserve.tokenizer import Tokenizer

    sock = _client(tiny_server.url, "grammar-client")
    try:
        sp = SamplingParams(max_tokens=50, temperature=1.0, structured=("regex", r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"))
        sock.send_multipart(encode(AddRequest("mail", (1, 2, 3), sp)))
        toks: list[int] = []
        while True:
            m = _recv_until(sock, lambda m: isinstance(m, StepOutputs)
                            and any(o.request_id == "mail" for o in m.outputs), timeout_ms=60000)
            out = next(o for o in m.outputs if o.request_id == "mail")
            toks += out.new_token_ids
            if out.finish_reason:
                break
    finally:
        sock.close(0)
    text = Tokenizer.from_gguf(smollm2_gguf_path()).decode(toks)
    assert out.finish_reason == "stop", out.error
    assert re.fullmatch(r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)", text), text
