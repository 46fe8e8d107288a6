"""Pooling requests made ready for the engine and run there, for every family that embeds or scores text.

OpenAI's ``/v1/embeddings``, vLLM's pooling routes and Cohere's ``/v2/rerank`` (``routers.pooling``) and Cohere's
``/v2/embed`` (``routers.cohere``) tokenize their inputs, check them against an engine's limits and send each input
to the pooling engines as a request of its own, all at once, with the same code: this module.
"""

from __future__ import annotations

import asyncio
import base64
from array import array

from protocol import EngineHello, PoolOutput

from ..errors import APIError, bad_request
from ..state import ModelState
from .admission import admit
from .engine_errors import ENGINE_ERRORS, engine_error

MAX_INPUTS = 2048  # items in one request
MAX_INPUT_CHARS = 1 << 20  # characters in one text item (tokenizing more is wasted work)


def pool_hello(state: ModelState, task: str, parts: int, param: str) -> EngineHello:
    """A ready engine's announcement, from one that serves ``task``, for a request of ``parts`` inputs to the engines
    (``admit`` refuses otherwise, naming ``param``)."""
    admit(state, task, parts, param, "inputs")
    return next(e.hello for e in state.engines.ready_engines if e.hello is not None and task in e.hello.tasks)


def check_count(n: int, param: str) -> None:
    if n > MAX_INPUTS:
        raise bad_request(f"{n} inputs; at most {MAX_INPUTS} per request", param=param)


def check_dimensions(hello: EngineHello, dimensions: int | None, param: str) -> None:
    """A 400 for ``dimensions`` the model cannot give: only a Matryoshka model's embedding may be cut shorter."""
    if dimensions is not None and (not hello.matryoshka or dimensions > hello.embed_size):
        why = (f"at most {hello.embed_size}" if hello.matryoshka else
               "this model does not support other dimensions (it is not a Matryoshka model)")
        raise bad_request(f"{param} {dimensions}: {why}", param=param)


def encode_input(state: ModelState, item: str | list[int], limit: int, truncate: int | None, param: str,
                 pair: str | None = None) -> list[int]:
    """Token ids of one input (with the model's special tokens), truncated only when asked; with
    ``pair``, of the two texts together, as a cross-encoder reads them."""
    return encode_pair(state, item, limit, truncate, param, pair)[0]


def encode_pair(state: ModelState, item: str | list[int], limit: int, truncate: int | None, param: str,
                pair: str | None = None) -> tuple[list[int], int]:
    """``encode_input``, and where the second text's tokens begin (0 for one text)."""
    if isinstance(item, list):
        ids = item[:truncate] if truncate else item
        vocab = state.tokenizer.vocab_size
        if any(t >= vocab for t in ids):
            raise bad_request(f"a token id is outside the vocabulary ({vocab})", param=param)
    else:
        backend = state.tokenizer.backend
        enc = backend.encode(item, pair, add_special_tokens=True)
        if truncate and len(enc.ids) > truncate:
            special = backend.num_special_tokens_to_add(pair is not None)
            raw = backend.encode(item, pair, add_special_tokens=False)
            raw.truncate(max(1, truncate - special))
            enc = backend.post_process(raw, add_special_tokens=True)
        ids = enc.ids
        pair_start = next((i for i, t in enumerate(enc.type_ids) if t), 0) if pair is not None else 0
    if not ids:
        raise bad_request("an input is empty", param=param)
    if len(ids) > limit:
        raise bad_request(f"an input has {len(ids)} tokens; this model takes at most {limit}. Shorten it or set "
                          "truncate_prompt_tokens", param=param)
    return ids, (pair_start if isinstance(item, str) else 0)


async def pool(state: ModelState, rid: str, inputs: list[list[int]], task: str, normalize: bool | None = None,
               dimensions: int | None = None, pair_starts: list[int] | None = None) -> list[PoolOutput]:
    """Every input's output, or the first failure: the request is served whole, so when one input fails (every
    engine's queue was full: one 429) the others are aborted rather than left to fill the queues."""
    starts = pair_starts or [0] * len(inputs)
    parts = [asyncio.ensure_future(state.engines.pool(f"{rid}-{i}", ids, task, normalize, dimensions, start))
             for i, (ids, start) in enumerate(zip(inputs, starts))]
    try:
        return list(await asyncio.gather(*parts))
    except ENGINE_ERRORS as e:
        raise engine_error(e) from None
    finally:
        for part in parts:
            part.cancel()  # (a no-op for one that ended; a cancelled one aborts its input in the engine)


def pool_usage(outs: list[PoolOutput]) -> dict:
    n = sum(o.num_prompt_tokens for o in outs)
    return {"prompt_tokens": n, "total_tokens": n}


def float32_base64(values: tuple[float, ...]) -> str:
    """An embedding as OpenAI and Cohere send it in base64: its little-endian float32 bytes."""
    packed = array("f", values)
    if packed.itemsize != 4:  # pragma: no cover - every platform we run on
        raise APIError(500, "float32 is not 4 bytes here")
    return base64.b64encode(packed.tobytes()).decode()
