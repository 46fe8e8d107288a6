"""A deadline on reading request bodies, so a client that trickles its body (slowloris) cannot hold a handler.

aiohttp has no body-read timeout: ``await request.read()`` waits as long as bytes keep coming, one a
second if the client likes, holding the connection, the handler and any concurrency slot it took.
``read_body`` (called by ``gateway.admission.gateway_middleware`` before the handler) reads the body within
``--body-timeout`` (default ``BODY_TIMEOUT_S``) plus the time its declared length takes at ``BODY_MIN_RATE``, and
answers 408 otherwise (a body without a length, chunked, gets the timeout alone). aiohttp keeps the bytes, so the
handler's own read returns them at once. After the 408 aiohttp reads what still comes for its lingering
time (10 s), then closes.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from .config import BODY_TIMEOUT_S
from .errors import APIError

BODY_MIN_RATE = 1 << 20  # bytes per second a large body must at least arrive at: 32 MiB gets 42 s


async def read_body(request: web.Request, timeout: float = BODY_TIMEOUT_S) -> None:
    """Have the whole body in memory before the handler runs, or raise the 408. A body that came with its
    headers (most do) is already complete: no timer is armed for it."""
    if request.body_exists and not request.content.is_eof():
        budget = timeout + (request.content_length or 0) / BODY_MIN_RATE
        try:
            async with asyncio.timeout(budget):
                await request.read()
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {budget:.0f}s",
                           headers={"Connection": "close"}) from None
