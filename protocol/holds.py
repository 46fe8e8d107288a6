"""Holds on admission: why gateways hold or refuse the new requests of a model, as the cluster state carries them.

A hold is keyed by (reason, model); ``model`` None holds every model (an operator's ``/pause``). A gateway
admits a request for model m unless a hold covers m, so pausing or rebuilding one model never holds another's
requests. What each reason does at the gateway is this module's one table, ``HOLD_REASONS``: a new reason is a
row here and a ``hold(reason, model)`` where the operation begins (the supervisor's admission owner publishes it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HoldReason:
    """What gateways do with a request a hold of this reason covers."""

    waits: bool  # held up to --scaling-wait (the hold ends by itself), else refused at once
    code: str  # the 503's error code
    message: str  # the 503's message: str.format with {what} (the server, or model X) and {detail}
    retry_after: str


HOLD_REASONS: dict[str, HoldReason] = {
    # An operator's /pause (of every model, or of one): it may last, so requests are refused at once.
    "paused": HoldReason(False, "server_paused", "{what} is paused and admits no new requests; retry later", "1"),
    # An expert-parallel resize or recovery of the model (detail: its phase): requests wait for it.
    "resizing": HoldReason(True, "server_scaling", "{what} is resizing its expert-parallel engine group ({detail}) "
                                                   "and admits no new requests; retry shortly", "5"),
    # A rolling restart replaces the model's only engine: requests wait for the replacement.
    "reloading": HoldReason(True, "server_scaling", "{what} is replacing its only engine (a rolling restart) and "
                                                    "admits no new requests; retry shortly", "5"),
    # The model sleeps (POST /sleep; detail: the level): requests wait for POST /wake_up.
    "sleeping": HoldReason(True, "model_sleeping", "{what} is asleep ({detail}) and admits no new requests until it "
                                                   "is woken (POST /wake_up); retry later", "5"),
    # Every engine of the model swaps in new weights (POST /update_weights): requests wait, then run on them.
    "updating": HoldReason(True, "server_scaling", "{what} is swapping in new weights and admits no new requests; "
                                                   "retry shortly", "2"),
    # Every engine of the model is crash-looping (detail: their last exits); the other models serve on.
    "failed": HoldReason(False, "model_failed", "{what} cannot serve: every engine of it is crash-looping "
                                                "({detail}); retry later", "30"),
}


@dataclass(frozen=True)
class Hold:
    reason: str  # a key of HOLD_REASONS
    model: str | None = None  # the model id it holds; None: every model
    since: float = 0.0  # when it began (unix time: ``launch status`` shows its age)
    detail: str = ""

    def __post_init__(self) -> None:
        if self.reason not in HOLD_REASONS:
            raise ValueError(f"hold reason must be one of {sorted(HOLD_REASONS)}")
        if not (self.model is None or (isinstance(self.model, str) and 0 < len(self.model) <= 1024)):
            raise TypeError("a hold's model must be a model id or null")
        if not (isinstance(self.since, (int, float)) and not isinstance(self.since, bool)):
            raise TypeError("a hold's since must be a unix time")
        if not (isinstance(self.detail, str) and len(self.detail) <= 4096):
            raise TypeError("a hold's detail must be a str of at most 4096 chars")

    @property
    def key(self) -> tuple[str, str | None]:
        return self.reason, self.model

    @property
    def waits(self) -> bool:
        return HOLD_REASONS[self.reason].waits

    def covers(self, model: str) -> bool:
        return self.model is None or self.model == model

    def message(self) -> str:
        what = "the server" if self.model is None else f"model {self.model!r}"
        return HOLD_REASONS[self.reason].message.format(what=what, detail=self.detail or self.reason)

    def to_json(self) -> dict:
        return {"reason": self.reason, "model": self.model, "since": self.since, "detail": self.detail}

    @classmethod
    def from_json(cls, d: object) -> Hold:
        """Raises TypeError/ValueError for a malformed hold (the control codec reports them)."""
        if not isinstance(d, dict) or not set(d) <= {"reason", "model", "since", "detail"}:
            raise TypeError("a hold is an object of reason, model, since and detail")
        return cls(d.get("reason", ""), d.get("model"), d.get("since", 0.0), d.get("detail", ""))


def first_hold(holds: tuple[Hold, ...], model: str) -> Hold | None:
    """The hold that decides a request for ``model``: one that refuses comes before one that waits (the request
    would be refused once the wait ended anyway)."""
    covering = [h for h in holds if h.covers(model)]
    return next((h for h in covering if not h.waits), None) or next(iter(covering), None)
