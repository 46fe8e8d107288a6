"""Log hygiene of a gateway: every line written while serving a request names its X-Request-Id, and a
malformed HTTP request is one rate-limited WARNING that quotes nothing the client sent.

aiohttp logs a request it cannot parse as an ERROR with a traceback whose message quotes the raw bad
line — a malformed ``Authorization`` header would put a key in the log. ``MalformedRequestFilter``
replaces those records with a line naming only the error's class, at most one per ``interval``.
"""

from __future__ import annotations

import contextvars
import logging
import time

from aiohttp.http_exceptions import HttpProcessingError

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("zserve_request_id", default=None)
"""The X-Request-Id of the request being served (set by ``gateway.admission``); tasks it starts inherit it."""

log = logging.getLogger("zserve.gateway")


class RequestIdFilter(logging.Filter):
    """Appends ``[request ID]`` to records written while a request is being served."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = REQUEST_ID.get()
        if rid is not None and not getattr(record, "_zserve_rid", False):
            record._zserve_rid = True  # once, though the record passes every handler
            if isinstance(record.args, tuple) and record.args:
                record.msg = f"{record.msg} [request %s]"
                record.args = (*record.args, rid)
            elif not record.args:
                record.msg = f"{record.msg} [request {rid}]"
        return True


class MalformedRequestFilter(logging.Filter):
    """Drops aiohttp's records about unparsable requests and writes one short WARNING instead, at most one per
    ``interval`` seconds (with how many were folded into it): a flood of bad requests cannot flood the log."""

    def __init__(self, interval: float = 10.0):
        super().__init__()
        self.interval = interval
        self.last = 0.0
        self.folded = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        now = time.monotonic()
        if now - self.last < self.interval:
            self.folded += 1
            return False
        folded, self.folded, self.last = self.folded, 0, now
        more = f" ({folded} more since the last such line)" if folded else ""
        log.warning("refused a malformed HTTP request: %s (status %s; its bytes are not logged)%s",
                    type(exc).__name__, getattr(exc, "code", "?"), more)
        return False


def install() -> None:
    """Attach both filters in this (gateway) process."""
    logging.getLogger("aiohttp.server").addFilter(MalformedRequestFilter())
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
