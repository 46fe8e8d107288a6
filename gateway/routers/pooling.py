"""The pooling family: embeddings, raw pooled vectors, scores, rerank and classification.

Every route tokenizes its inputs here and sends each one to a pooling engine as its own
``PoolRequest``, all at once: the engine batches them (with other clients' inputs) under its token
budget, so a request of 64 inputs costs one or two forward passes, not 64.

- ``/v1/embeddings`` (OpenAI): strings or token ids; ``encoding_format`` float or base64 (little-
  endian float32, as OpenAI sends it); ``dimensions`` for Matryoshka models only.
- ``/pooling`` (vLLM): the model's pooled vectors, not normalised.
- ``/score``, ``/v1/score`` (vLLM): ``text_1`` against ``text_2`` (1:1, 1:N or N:N pairwise); a
  bi-encoder scores by the cosine of the two embeddings, a cross-encoder (a classify model with one
  label) by its head on the pair, through a sigmoid (as sentence-transformers' CrossEncoder does).
- ``/rerank``, ``/v1/rerank`` (Jina) and ``/v2/rerank`` (Cohere): the documents by their score
  against the query, best first; ``top_n`` and ``return_documents``.
- ``/classify`` (vLLM): the label and class probabilities (softmax of the head's logits).

Inputs longer than the model's context are a 400 unless the request sets ``truncate_prompt_tokens``
(then each input keeps its first tokens, special tokens included).
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import ConfigDict, Field

from protocol import EngineHello

from ..errors import bad_request
from ..ids import random_hex
from ..openai_schemas import RequestBody, parse
from ..openapi import request_body
from ..serving.admission import admit
from ..serving.pooling import (
    MAX_INPUT_CHARS,
    check_count,
    check_dimensions,
    encode_input,
    encode_pair,
    float32_base64,
    pool,
    pool_hello,
    pool_usage,
)
from ..serving.shapes import json_body
from ..state import STATE, GatewayState, ModelState

routes = web.RouteTableDef()


Text = Annotated[str, Field(max_length=MAX_INPUT_CHARS)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Truncate = Annotated[int, Field(ge=1)] | None


class EmbeddingRequest(RequestBody):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: Text | Annotated[list[Text], Field(min_length=1)] | TokenIds | Annotated[list[TokenIds], Field(min_length=1)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1)] | None = None
    user: str | None = None
    truncate_prompt_tokens: Truncate = None
    normalize: bool | None = None  # vLLM: None = the model's default


class ScoreRequest(RequestBody):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    text_1: Text | Annotated[list[Text], Field(min_length=1)]
    text_2: Text | Annotated[list[Text], Field(min_length=1)]
    truncate_prompt_tokens: Truncate = None


class RerankDocument(RequestBody):
    model_config = ConfigDict(extra="ignore")

    text: Text


class RerankRequest(RequestBody):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    query: Text
    documents: Annotated[list[Text | RerankDocument], Field(min_length=1)]
    top_n: Annotated[int, Field(ge=0)] | None = None
    return_documents: bool = True
    truncate_prompt_tokens: Truncate = None


class ClassifyRequest(RequestBody):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: Text | Annotated[list[Text], Field(min_length=1)]
    truncate_prompt_tokens: Truncate = None


SCORE_TASKS = ("embed", "classify")  # score and rerank: cosine of embeddings, or a cross-encoder's head


# -- helpers ------------------------------------------------------------------------------------

def _items(value: Any) -> list:
    """One input or a list of them, as a list (a list of token ids is one input)."""
    if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)):
        return [value]
    return list(value)


def _inputs(state: GatewayState, req: EmbeddingRequest | ClassifyRequest, task: str
            ) -> tuple[ModelState, EngineHello, list[list[int]]]:
    """The request's model, an engine's announcement for ``task`` and the token ids of every input."""
    view = state.for_model(req.model, task)
    items = _items(req.input)
    check_count(len(items), "input")
    hello = pool_hello(view, task, len(items), "input")
    limit, truncate = hello.max_model_len, req.truncate_prompt_tokens
    return view, hello, [encode_input(view, it, limit, truncate, "input") for it in items]


def _listing(rid: str, model: str, data: list[dict], usage: dict) -> web.Response:
    """vLLM's envelope of the pooling, score and classify answers."""
    return json_body({"id": rid, "object": "list", "created": int(time.time()), "model": model,
                      "data": data, "usage": usage})


def _cosine(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(y * y for y in b))
    return dot / (na * nb) if na and nb else 0.0


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _softmax(xs: tuple[float, ...]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    total = sum(e)
    return [v / total for v in e]


async def _scores(state: ModelState, rid: str, model: str, queries: list[str], docs: list[str],
                  truncate: int | None, param: str) -> tuple[list[float], dict]:
    """The score of each (query, doc) pair (queries broadcast when there is one), and the usage."""
    if len(queries) == 1:
        queries = queries * len(docs)
    elif len(queries) != len(docs):
        raise bad_request(f"text_1 has {len(queries)} texts and text_2 {len(docs)}: give one text_1, or as many as "
                          "text_2", param="text_2")
    check_count(len(docs), param)  # (each text is one input, however often it is paired)
    hellos = [e.hello for e in state.engines.ready_engines if e.hello is not None]
    cross = next((h for h in hellos if "classify" in h.tasks and len(h.labels) <= 1), None)
    if cross is not None:  # a cross-encoder reads each pair together
        admit(state, "classify", len(docs), param, "inputs (query and document pairs)")
        pairs = [encode_pair(state, q, cross.max_model_len, truncate, param, pair=d)
                 for q, d in zip(queries, docs)]
        outs = await pool(state, rid, [p[0] for p in pairs], "classify", pair_starts=[p[1] for p in pairs])
        return [_sigmoid(o.data[0]) for o in outs], pool_usage(outs)
    uniq = list(dict.fromkeys(queries + docs))  # embed each distinct text once
    hello = pool_hello(state, "embed", len(uniq), param)
    ids = [encode_input(state, t, hello.max_model_len, truncate, param) for t in uniq]
    outs = await pool(state, rid, ids, "embed")
    vec = {t: o.data for t, o in zip(uniq, outs)}
    return [_cosine(vec[q], vec[d]) for q, d in zip(queries, docs)], pool_usage(outs)


# -- routes -------------------------------------------------------------------------------------

@routes.post("/v1/embeddings")
@request_body(EmbeddingRequest)
async def embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = parse(EmbeddingRequest, await request.read())
    state, hello, ids = _inputs(state, req, "embed")
    check_dimensions(hello, req.dimensions, "dimensions")
    outs = await pool(state, f"embd-{random_hex()}", ids, "embed", req.normalize, req.dimensions)
    data = [{"object": "embedding", "index": i,
             "embedding": float32_base64(o.data) if req.encoding_format == "base64" else list(o.data)}
            for i, o in enumerate(outs)]
    return json_body({"object": "list", "data": data, "model": state.name, "usage": pool_usage(outs)})


@routes.post("/pooling")
@request_body(EmbeddingRequest)
async def pooling(request: web.Request) -> web.Response:
    """vLLM's raw pooled vectors: the embedding before normalisation."""
    state = request.app[STATE]
    req = parse(EmbeddingRequest, await request.read())
    state, _, ids = _inputs(state, req, "embed")
    rid = f"pool-{random_hex()}"
    outs = await pool(state, rid, ids, "embed", normalize=False if req.normalize is None else req.normalize)
    data = [{"index": i, "object": "pooling", "data": list(o.data)} for i, o in enumerate(outs)]
    return _listing(rid, state.name, data, pool_usage(outs))


@routes.post("/score")
@routes.post("/v1/score")
@request_body(ScoreRequest)
async def score(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = parse(ScoreRequest, await request.read())
    state = state.for_model(req.model, SCORE_TASKS)
    model = state.name
    rid = f"score-{random_hex()}"
    scores, usage = await _scores(state, rid, model, _items(req.text_1), _items(req.text_2),
                                  req.truncate_prompt_tokens, "text_2")
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return _listing(rid, model, data, usage)


async def _rerank(request: web.Request) -> tuple[str, str, list[dict], dict]:
    """(id, model, results best first, usage): what both rerank shapes carry."""
    state = request.app[STATE]
    req = parse(RerankRequest, await request.read())
    state = state.for_model(req.model, SCORE_TASKS)
    model = state.name
    docs = [d if isinstance(d, str) else d.text for d in req.documents]
    rid = f"rerank-{random_hex()}"
    scores, usage = await _scores(state, rid, model, [req.query], docs, req.truncate_prompt_tokens, "documents")
    ranked = sorted(range(len(docs)), key=lambda i: -scores[i])[: req.top_n or None]
    results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": docs[i]}} if req.return_documents
                                                             else {})} for i in ranked]
    return rid, model, results, usage


@routes.post("/rerank")
@routes.post("/v1/rerank")
@request_body(RerankRequest)
async def rerank_jina(request: web.Request) -> web.Response:
    rid, model, results, usage = await _rerank(request)
    return json_body({"id": rid, "model": model, "usage": {"total_tokens": usage["total_tokens"]},
                      "results": results})


@routes.post("/v2/rerank")
@request_body(RerankRequest)
async def rerank_cohere(request: web.Request) -> web.Response:
    rid, _, results, usage = await _rerank(request)
    return json_body({"id": rid, "results": results, "meta": {
        "api_version": {"version": "2"}, "billed_units": {"search_units": 1},
        "tokens": {"input_tokens": usage["prompt_tokens"], "output_tokens": 0}}})


@routes.post("/classify")
@request_body(ClassifyRequest)
async def classify(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = parse(ClassifyRequest, await request.read())
    state, hello, ids = _inputs(state, req, "classify")
    rid = f"classify-{random_hex()}"
    outs = await pool(state, rid, ids, "classify")
    data = []
    for i, o in enumerate(outs):
        probs = _softmax(o.data)
        best = max(range(len(probs)), key=probs.__getitem__)
        label = hello.labels[best] if best < len(hello.labels) else f"LABEL_{best}"
        data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
    return _listing(rid, state.name, data, pool_usage(outs))
