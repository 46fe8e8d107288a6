"""An engine that is one member of an expert-parallel group (``launch api-server --expert-parallel``).

It serves its own requests like any engine (attention is data parallel) but steps in lockstep with the
group, because every MoE layer is a collective (``expert_parallel``). The loop:

- **Idle.** While no member has work, nobody steps: each member waits on its sockets like a lone engine
  (no CPU spent). ``epoch`` counts the group's idle periods.
- **Waking.** A member that gets work while idle starts stepping and sends every other member a
  ``GroupWake(generation, epoch)`` over their engine sockets; a member idle in that epoch starts stepping
  too. A wake from an epoch already over is stale and ignored, so a late wake never makes one member
  step alone.
- **Active.** Each turn every member takes exactly one group step: its real batch, or an empty step
  (``ModelRunner.idle_step``) when it has nothing scheduled. The step that finds the whole group without
  tokens ends the active period on every member at once (they all saw the same counts), and the epoch
  advances.

The supervisor forms the group through the control pipe (``GroupCommand``): leave the old group, hold
the new share of experts (``SparseMoE.reshard``: keep, load, release), meet at the rendezvous file, and
report ``GroupReport``. Until then, and while re-forming, the engine steps nothing; requests that arrive
wait in its queue (their KV cache stays valid: only experts move). A collective that fails (a member
died) hands every request here back to its gateway (``ERR_GROUP_LOST``: it is sent again, with the
tokens it produced, once the group is formed again), leaves the group and reports ``lost``; the
supervisor re-forms the group.
"""

from __future__ import annotations

import logging
import time

import zmq

from protocol import ErrorMessage, encode
from protocol.constants import ERR_ENGINE_DRAINING, ERR_GROUP_LOST
from protocol.control import ControlMessage, GroupCommand, GroupFreeze, GroupReport
from protocol.messages import GroupWake
from zserve.catalog import ModelSource
from zserve.curve import secure_client

from .expert_parallel import ExpertGroup, GroupLost, expert_shard
from .server import EngineServer

log = logging.getLogger("zserve.engine")

JOIN_TIMEOUT_S = 60.0  # a rendezvous waits this long for every member before it fails
JOIN_POLL_MS = 20  # how often a rendezvous looks for every member (and for a newer command)


class GroupedEngineServer(EngineServer):
    def __init__(self, *args, source: ModelSource, **kw):
        super().__init__(*args, source=source, **kw)
        self.source = source
        self.group: ExpertGroup | None = None
        self.generation = -1  # of the last GroupCommand carried out
        self.epoch = 0  # the group's idle periods so far
        self.woken = -1  # the latest epoch a member woke us for
        self.active = False
        self.peers: list[zmq.Socket] = []
        self.commands: list[GroupCommand] = []  # read from the pipe, not yet carried out
        self._reader = None  # reads new experts from the checkpoint (made on the first reshard)
        self.freezing = False  # told to freeze: finishing the requests here first
        self.frozen = False  # frozen: requests that arrive wait; no group step is started for them
        self.share: tuple[int, int] | None = None  # (member, size) in the group it serves in

    # -- inbound ---------------------------------------------------------------------------------------
    def on_control(self, msg: ControlMessage) -> None:
        if isinstance(msg, GroupCommand):
            self.commands.append(msg)
        elif isinstance(msg, GroupFreeze):
            if msg.generation == self.generation:
                self.freezing, self.frozen = msg.frozen, False
        else:
            super().on_control(msg)

    # An engine operation (``operations``) that waits for the running requests runs only while the whole group is
    # idle (every member stopped at the same empty step), never between two group steps of a busy group.
    def quiet(self) -> bool:
        return not self.active

    def expert_share(self) -> tuple[int, int] | None:
        return self.share

    def use_source(self, source: ModelSource) -> None:
        self.source, self._reader = source, None

    def on_wake(self, msg: GroupWake) -> None:
        if msg.generation == self.generation:
            self.woken = max(self.woken, msg.epoch)

    # -- the loop --------------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        while not (self.draining and not self.scheduler.has_work and not self.active):
            self.loop_tick = time.monotonic()
            if self.commands:
                # Only the newest matters; taken before carrying it out, so that a newer one that arrives
                # meanwhile (it abandons this rendezvous) is carried out next rather than dropped.
                newest, self.commands = self.commands[-1], []
                self.regroup(newest)
                continue
            if self.group is None:
                if self.draining and self.scheduler.has_work:
                    self.end_requests()  # a leaver steps no more: requests it still holds go elsewhere
                self.poll_inbound(int(self.stats_interval * 1000))
                self.publish_stats()
                continue
            self.ops.poll()
            self.scheduler.hold_new = self.ops.holding
            busy = self.scheduler.has_work and not self.ops.asleep  # (asleep: requests wait for the wake)
            if busy and self.draining and not self.active:
                self.end_requests()  # taken just before SIGTERM (a leaver): another member serves them
                continue
            if self.freezing and not self.active and not busy:
                self.freezing, self.frozen = False, True
                self.status.send(GroupReport(self.generation, "frozen"))
            if not self.active and (self.woken >= self.epoch or (busy and not self.frozen)):
                self.active = True
                if self.woken < self.epoch:
                    self._wake_peers()
            if not self.active:
                self.poll_inbound(int(self.stats_interval * 1000))
                self.publish_stats()
                continue
            self.poll_inbound(2 if self._stalled else 0)
            try:
                self.group_step()
            except GroupLost as e:
                self.lost(e)
            self.publish_stats()
        self.publish_stats()
        self.leave()
        log.info("engine %d drained; exiting", self.rank)

    def group_step(self) -> None:
        """Exactly one group step: the batch when one is scheduled, else an empty one."""
        group = self.group
        assert group is not None
        before = group.steps
        if self.scheduler.has_work:
            self.step()
        if group.steps == before and not self.runner.idle_step():
            self.active = False  # every member saw a group without tokens: all stop together
            self.epoch += 1

    def _wake_peers(self) -> None:
        frames = encode(GroupWake(self.generation, self.epoch))
        for peer in self.peers:
            try:
                peer.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:  # not connected (it died): the step's collective reports it
                pass

    # -- forming and losing the group --------------------------------------------------------------------
    def regroup(self, cmd: GroupCommand) -> None:
        if cmd.generation <= self.generation:
            return
        t0 = time.monotonic()
        self.leave()
        self.generation = cmd.generation
        model = self.runner.model
        shard = expert_shard(model.config.num_experts, cmd.size, cmd.rank)
        try:
            if list(shard) != model.expert_ids:
                if self._reader is None:
                    from .loader import hf_tensor_reader

                    self._reader = hf_tensor_reader(self.source)
                model.reshard(shard, self._reader)
            group = ExpertGroup.form(cmd.store, cmd.rank, cmd.size, cmd.generation, self.runner.device,
                                     join_timeout=JOIN_TIMEOUT_S, abandon=self._newer_command, backend=cmd.backend)
        except Exception as e:  # GroupLost, a checkpoint that cannot be read, out of memory
            log.error("engine %d could not join expert-parallel group %d (member %d of %d): %s", self.rank,
                      cmd.generation, cmd.rank, cmd.size, e)
            self.status.send(GroupReport(cmd.generation, "failed", reason=str(e)[:4000]))
            return
        if cmd.threads is not None and self.runner.device.type == "cpu":
            from .device import configure_cpu_threads

            configure_cpu_threads(cmd.threads)  # the cores are shared among the group's new size
        self.group = group
        self.share = (cmd.rank, cmd.size)
        self.runner.set_group(group)
        self.epoch, self.woken, self.active = 0, -1, False
        self.freezing = self.frozen = False
        self.peers = []
        for i, endpoint in enumerate(cmd.peers):
            if i != cmd.rank:
                peer = self.ctx.socket(zmq.DEALER)
                peer.setsockopt(zmq.LINGER, 0)
                if self.keys is not None:
                    secure_client(peer, self.keys)  # with the engine host's own keypair, which its engines accept
                peer.connect(endpoint)
                self.peers.append(peer)
        log.info("engine %d joined expert-parallel group %d as member %d of %d (experts %d..%d) in %.2fs", self.rank,
                 cmd.generation, cmd.rank, cmd.size, shard.start, shard.stop - 1, time.monotonic() - t0)
        self.status.send(GroupReport(cmd.generation, "formed", experts=(shard.start, shard.stop)))

    def _newer_command(self) -> bool:
        """While waiting at a rendezvous: whether the supervisor has sent a newer command (give up this one)."""
        self.poll_inbound(JOIN_POLL_MS)  # requests keep arriving; they wait in the queue
        self.loop_tick = time.monotonic()
        return any(c.generation > self.generation for c in self.commands)

    def leave(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
            self.runner.set_group(None)
        for peer in self.peers:
            peer.close(0)
        self.peers = []
        self.active = False

    def lost(self, error: GroupLost) -> None:
        """A collective failed: hand every request here back to its gateway, leave the group, tell the supervisor."""
        n = self.end_requests(ERR_ENGINE_DRAINING if self.draining else ERR_GROUP_LOST)
        log.error("engine %d: %s; handed %d request(s) back; waiting for the group to be formed again", self.rank,
                  error, n)
        generation = self.generation
        self.leave()
        self.status.send(GroupReport(generation, "lost", reason=str(error)[:4000]))

    def end_requests(self, code: str = ERR_ENGINE_DRAINING) -> int:
        """End every request here and hand each back to its gateway with ``code``: ERR_ENGINE_DRAINING (a leaver
        steps no more: another member serves them) or ERR_GROUP_LOST (the group lost a member: the gateway sends
        them again once an engine of the model is ready, this one when the group has re-formed). A request that
        had produced tokens goes on from them there (a migration), unless its gateway's --migration-limit says no."""
        seqs = self.scheduler.abort_all("abort")
        why = (f"engine {self.rank} is leaving its expert-parallel group" if code == ERR_ENGINE_DRAINING
               else f"engine {self.rank}'s expert-parallel group lost a member while serving this request")
        for s in seqs:
            client = self.requests.pop(s.request_id, None)
            if client is not None:
                self.send(client, ErrorMessage(code, why, s.request_id))
        return len(seqs)
