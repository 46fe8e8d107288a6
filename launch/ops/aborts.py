"""Aborting client requests whichever gateway serves them (``POST /abort_requests``): the supervisor asks every
gateway (``AbortRequests``) and answers once each said which of the ids it was serving (``AbortReport``), or after
``GATEWAY_TIMEOUT``. A client names a request by ``/inference/v1/generate``'s ``request_id`` or by its
``X-Request-Id``; ids no gateway knew are reported, not an error (they may have finished already)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from protocol.control import AbortCommand, AbortReply, AbortReport, AbortRequests

from ..children import Child
from ..control_server import Later
from ..interfaces import Processes

GATEWAY_TIMEOUT = 5.0  # seconds every gateway has to answer


@dataclass
class _Abort:
    ids: tuple[str, ...]
    answer: Later
    deadline: float
    waiting: set[str] = field(default_factory=set)  # the gateways that have not answered
    found: set[str] = field(default_factory=set)


class Aborts:
    def __init__(self, processes: Processes):
        self.processes = processes
        self.pending: dict[int, _Abort] = {}
        self._ids = 0

    def request(self, cmd: AbortCommand, answer: Later) -> Later:
        self._ids += 1
        ab = _Abort(cmd.request_ids, answer, time.monotonic() + GATEWAY_TIMEOUT)
        msg = AbortRequests(self._ids, cmd.request_ids)
        for c in self.processes.live("gateway"):
            if c.ready and c.send(msg):
                ab.waiting.add(c.name)
        self.pending[self._ids] = ab
        self.tick(time.monotonic())
        return answer

    def on_report(self, child: Child, msg: AbortReport) -> None:
        ab = self.pending.get(msg.id)
        if ab is not None:
            ab.waiting.discard(child.name)
            ab.found.update(i for i in msg.found if i in ab.ids)

    def tick(self, now: float) -> None:
        live = {c.name for c in self.processes.live("gateway")}
        for key, ab in list(self.pending.items()):
            if not (ab.waiting & live) or now > ab.deadline:
                del self.pending[key]
                ab.answer.set(AbortReply(tuple(i for i in ab.ids if i in ab.found),
                                         tuple(i for i in ab.ids if i not in ab.found)))
