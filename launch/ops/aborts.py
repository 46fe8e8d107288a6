"""Aborting client requests whichever gateway serves them (``POST /abort_requests``): the supervisor asks every
gateway (``AbortRequests``) and answers once each said which of the ids it was serving (``AbortReport``), or after
``GATEWAY_TIMEOUT``. With gateway hosts sharing a Redis state, the other hosts are asked too
(``SharedControl.post_abort``): each carries the abort out on its gateways and writes what it found, which this
host merges. A client names a request by ``/inference/v1/generate``'s ``request_id`` or by its ``X-Request-Id``;
ids no gateway knew are reported, not an error (they may have finished already)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol.control import AbortCommand, AbortReply, AbortReport, AbortRequests

from ..children import Child
from ..control_server import Later
from ..hosts.shared_state import SharedControl
from ..interfaces import Processes

GATEWAY_TIMEOUT = 5.0  # seconds every gateway (and every other gateway host) has to answer


@dataclass
class _Abort:
    ids: tuple[str, ...]
    done: Callable[[list[str]], None]  # called once with the ids found
    deadline: float
    waiting: set[str] = field(default_factory=set)  # the gateways here that have not answered
    found: set[str] = field(default_factory=set)
    shared_key: str | None = None  # asked of the other gateway hosts too, under this key
    hosts: set[str] = field(default_factory=set)  # the other hosts that have not answered


class Aborts:
    def __init__(self, processes: Processes, shared: Callable[[], SharedControl | None] = lambda: None):
        self.processes = processes
        self.shared = shared
        self.pending: dict[int, _Abort] = {}
        self._ids = 0

    def request(self, cmd: AbortCommand, answer: Later) -> Later:
        """An abort asked through a gateway of this host: of every gateway of every host."""
        ids = cmd.request_ids

        def done(found: list[str]) -> None:
            answer.set(AbortReply(tuple(i for i in ids if i in found), tuple(i for i in ids if i not in found)))

        ab = self._start(ids, done)
        shared = self.shared()
        if shared is not None:
            ab.hosts = shared.live_hosts()
            ab.shared_key = shared.post_abort(ids) if ab.hosts else None
        self.tick(time.monotonic())
        return answer

    def follow_shared(self, shared: SharedControl) -> None:
        """Carry out the aborts other gateway hosts asked for, and answer each in the shared state."""
        for key, ids in shared.take_aborts():
            self._start(ids, lambda found, key=key: shared.answer_abort(key, found))

    def _start(self, ids: tuple[str, ...], done: Callable[[list[str]], None]) -> _Abort:
        self._ids += 1
        ab = _Abort(ids, done, time.monotonic() + GATEWAY_TIMEOUT)
        msg = AbortRequests(self._ids, ids)
        for c in self.processes.live("gateway"):
            if c.ready and c.send(msg):
                ab.waiting.add(c.name)
        self.pending[self._ids] = ab
        return ab

    def on_report(self, child: Child, msg: AbortReport) -> None:
        ab = self.pending.get(msg.id)
        if ab is not None:
            ab.waiting.discard(child.name)
            ab.found.update(i for i in msg.found if i in ab.ids)

    def tick(self, now: float) -> None:
        live = {c.name for c in self.processes.live("gateway")}
        shared = self.shared()
        for key, ab in list(self.pending.items()):
            if ab.shared_key is not None and shared is not None and ab.hosts:
                found, answered = shared.abort_answers(ab.shared_key)
                ab.found.update(i for i in found if i in ab.ids)
                ab.hosts -= answered
            if (not (ab.waiting & live) and not (ab.hosts and ab.shared_key)) or now > ab.deadline:
                del self.pending[key]
                ab.done(sorted(ab.found))
